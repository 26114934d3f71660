"""json: pdserve's own form, the one the grammar holds a tool_choice "required" or named function
to: the whole output is a JSON array of calls,

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {...}]

so the content is None. An output cut short (max_tokens) keeps the calls that are whole; the rest
of its text is content, as for any text that is not a call."""

from __future__ import annotations

from pdserve.common.tool_parsers._base import JsonSequence


class JsonArray(JsonSequence):
    SEPARATORS = ","
    CLOSE = "]"

    def opening(self, final: bool) -> int | None:
        lead = self.buf.lstrip()
        if lead.startswith("["):
            return len(self.buf) - len(lead) + 1
        return None if not (final or lead) else -1
