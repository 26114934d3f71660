"""Chat messages as the chat template takes them: role and text, and a VLM's images.

OpenAI content parts other than text need an encoder. A vision-language model reads `image_url`
parts (data: URLs; http(s) only with vision.allow_remote_urls): each becomes its placeholder text
(`<image>`) in the message and an image, decoded here with Pillow so that a bad one is a 400
naming its part. Every other part, and an image for a text-only model, is refused with a 400,
never dropped: a model that silently loses the image still answers, confidently, a question it
never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.errors import APIError
from pdserve.common.images import ImageError, decode_data_url, image_digest, open_image
from pdserve.common.remote_images import fetch_image, parse_networks
from pdserve.config import VisionConfig
from pdserve.protocol import ChatMessage

# What each non-text part would need; any other type is simply unknown.
_NEEDS = {
    "image_url": "vision encoder",
    "input_image": "vision encoder",
    "input_audio": "audio encoder",
    "audio_url": "audio encoder",
    "video_url": "video encoder",
    "file": "file reader",
}


@dataclass
class ChatInputs:
    messages: list[dict]
    images: list[tuple[bytes, bytes]] = field(default_factory=list)  # (digest, file bytes), in order


def chat_messages(messages: list[ChatMessage], model: str) -> list[dict]:
    """[{"role", "content"}] with each message's text parts joined; raises APIError(400) at the
    first part this text-only model cannot read."""
    return chat_inputs(messages, model).messages


def chat_inputs(
    messages: list[ChatMessage],
    model: str,
    placeholder: str | None = None,
    limits: VisionConfig | None = None,
) -> ChatInputs:
    """Messages and images; `placeholder` (a VLM's image text) None means a text-only model.
    Decodes the images (Pillow): call it off the event loop when images may come."""
    limits = limits or VisionConfig()
    out = ChatInputs([])
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            out.messages.append(_with_tool_fields({"role": m.role, "content": m.text()}, m))
            continue
        texts = []
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type in ("text", "refusal"):
                text = part.text if part.type == "text" else part.refusal
                if not isinstance(text, str):
                    raise APIError(
                        400,
                        f"{where}: a {part.type} part needs its {part.type!r} field",
                        where,
                        "invalid_value",
                    )
                texts.append(text)
                continue
            if part.type == "image_url" and placeholder is not None:
                out.images.append(_image(part.image_url, where, len(out.images), limits))
                texts.append(placeholder)
                continue
            need = _NEEDS.get(part.type)
            why = (
                f"the model {model!r} has no {need} for {part.type!r} parts"
                if need
                else f"unknown content part type {part.type!r}"
            )
            raise APIError(400, f"{where}: {why}; send text parts only", where, "unsupported_content")
        out.messages.append(_with_tool_fields({"role": m.role, "content": "".join(texts)}, m))
    return out


def _with_tool_fields(msg: dict, m: ChatMessage) -> dict:
    """An assistant's tool_calls, a tool message's tool_call_id and name, as templates read them."""
    if m.tool_calls:
        msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        msg["name"] = m.name
    return msg


def _image(image_url: object, where: str, count: int, limits: VisionConfig) -> tuple[bytes, bytes]:
    url = getattr(image_url, "url", image_url)
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}: an image_url part needs its 'image_url.url'", where, "invalid_value")
    if count >= limits.max_images:
        raise APIError(
            400, f"{where}: more than {limits.max_images} images in one request", where, "too_many_images"
        )
    try:
        if url.startswith("data:"):
            data = decode_data_url(url, limits.max_image_bytes)
        elif url.startswith(("http://", "https://")):
            if not limits.allow_remote_urls:
                raise ImageError(
                    "remote image URLs are off on this server (vision.allow_remote_urls); "
                    "send the image as a base64 data: URL"
                )
            data = _fetch(url, limits)
        else:
            raise ImageError("not a data: or http(s) URL")
        open_image(data, limits.max_image_pixels)  # decodable, and not too many pixels
    except ImageError as e:
        raise APIError(400, f"{where}: {e}", where, "invalid_image") from e
    return image_digest(data), data


def _fetch(url: str, limits: VisionConfig) -> bytes:
    return fetch_image(
        url, limits.max_image_bytes, limits.remote_timeout_s, parse_networks(limits.remote_url_allow_networks)
    )
