"""hermes (Hermes-2-Pro, Qwen2.5, Qwen3): each call a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

as many as the model makes, with text before, between and after them."""

from __future__ import annotations

from pdserve.common.tool_parsers._base import Tagged, loads


class Hermes(Tagged):
    START, END = "<tool_call>", "</tool_call>"
    OPENS = "{"

    def body(self, text: str) -> tuple[str, str] | None:
        try:
            obj = loads(text)
        except ValueError:
            return None
        return self.from_object(obj)
