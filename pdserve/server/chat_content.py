"""Chat messages as the chat template takes them: role and text.

OpenAI content parts other than text (`image_url`, `input_audio`, `file`, ...) need an encoder
this model does not have. They are refused with a 400 naming the part, never dropped: a model
that silently loses the image still answers, confidently, a question it never saw.
"""
from __future__ import annotations

from pdserve.protocol import ChatMessage
from pdserve.server.errors import APIError

# What each non-text part would need; any other type is simply unknown.
_NEEDS = {"image_url": "vision encoder", "input_image": "vision encoder", "input_audio": "audio encoder",
          "audio_url": "audio encoder", "video_url": "video encoder", "file": "file reader"}


def chat_messages(messages: list[ChatMessage], model: str) -> list[dict[str, str]]:
    """[{"role", "content"}] with each message's text parts joined; raises APIError(400) at the
    first part this text-only model cannot read."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if part.type in ("text", "refusal"):
                    if not isinstance(part.text if part.type == "text" else part.refusal, str):
                        raise APIError(400, f"{where}: a {part.type} part needs its {part.type!r} field",
                                       where, "invalid_value")
                    continue
                need = _NEEDS.get(part.type)
                why = (f"the model {model!r} has no {need} for {part.type!r} parts" if need
                       else f"unknown content part type {part.type!r}")
                raise APIError(400, f"{where}: {why}; send text parts only", where, "unsupported_content")
        out.append({"role": m.role, "content": m.text()})
    return out
