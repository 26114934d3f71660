"""Tool calls in a model's output: the text the chat template taught the model to write for a call,
read back into OpenAI's `tool_calls` (one module per format), streamed as OpenAI's deltas too.

One state machine serves both ways of answering: the whole text is fed once and finished, a stream
is fed delta by delta, so the streamed content and argument pieces add up to the whole answer's.
Something that looks like a call but does not parse, or names a tool the request did not offer, is
not a call: its text stays content. A marker split across deltas is held back until it is whole.
Each call's arguments come in one delta, when the call is whole: a call is only known to be one
when it has parsed, and a streamed piece cannot be taken back."""

from __future__ import annotations

from collections.abc import Collection

from pdserve.common.tool_parsers._base import Format, ToolCall, ToolCallDelta, make_call_id
from pdserve.common.tool_parsers.deepseek import CALLS_BEGIN, DeepSeekV3
from pdserve.common.tool_parsers.hermes import Hermes
from pdserve.common.tool_parsers.json_array import JsonArray
from pdserve.common.tool_parsers.llama3 import PYTHON_TAG, Llama3Json
from pdserve.common.tool_parsers.mistral import TOOL_CALLS, Mistral
from pdserve.common.tool_parsers.qwen3_coder import Qwen3Coder

__all__ = [
    "PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "make_call_id",
    "parse",
    "parser_for_template",
]

_FORMATS: dict[str, type[Format]] = {
    "hermes": Hermes,
    "qwen": Hermes,  # Qwen2.5 and Qwen3 write hermes' form
    "qwen3": Hermes,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "qwen3_coder": Qwen3Coder,
    "deepseek_v3": DeepSeekV3,
    "deepseek_v31": DeepSeekV3,  # one parser reads both forms
    "json": JsonArray,
}
PARSERS: tuple[str, ...] = tuple(_FORMATS)


class ToolParser:
    def __init__(self, kind: str, tool_names: Collection[str] | None = None) -> None:
        """`tool_names`: the request's tools; a call to any other name is content. None: any name."""
        if kind not in _FORMATS:
            raise ValueError(f"unknown tool-call parser {kind!r}; known: {', '.join(PARSERS)}")
        self.kind = kind
        self._format = _FORMATS[kind](tool_names)
        self._finished = False

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls so far (all of them after finish()), with the ids their deltas had."""
        return self._format.calls

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, tool-call deltas) this text adds, as far as can be told yet."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._format.buf += text
        return self._format.run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is still held back, at the end of the output."""
        if self._finished:
            return "", []
        self._finished = True
        return self._format.run(final=True)


def parse(
    kind: str, text: str, tool_names: Collection[str] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """The whole output's (content, calls); content is None when there are calls and it is empty
    or only whitespace."""
    p = ToolParser(kind, tool_names)
    c1, _ = p.feed(text)
    c2, _ = p.finish()
    content = c1 + c2
    return (None if p.calls and not content.strip() else content), p.calls


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template's text teaches its model to need, or None when none is known."""
    t = chat_template or ""
    if CALLS_BEGIN in t:
        return "deepseek_v3"
    if TOOL_CALLS in t:
        return "mistral"
    if "<function=" in t and "<parameter=" in t:  # before hermes: Qwen3-Coder's calls are in <tool_call> too
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if PYTHON_TAG in t or ("<|start_header_id|>" in t and "ipython" in t):
        return "llama3_json"
    return None
