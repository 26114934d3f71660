"""llama3_json (Llama 3.1, 3.2, 3.3): with custom tools the whole answer is the call, a JSON object

    {"name": "get_weather", "parameters": {"city": "Paris"}}

perhaps after the <|python_tag|> token, several separated by ";" ("arguments" is accepted for
"parameters"). Only an output that opens (after whitespace) with "{" or <|python_tag|> is read for
calls; any other is content. An object without parameters is content: nothing but the object's
shape tells a call from an answer that is JSON."""

from __future__ import annotations

from pdserve.common.tool_parsers._base import JsonSequence

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(JsonSequence):
    SEPARATORS = ";"
    BARE = True
    NEED_ARGS = True

    def opening(self, final: bool) -> int | None:
        lead = self.buf.lstrip()
        skip = len(self.buf) - len(lead)
        if lead.startswith(PYTHON_TAG):
            return skip + len(PYTHON_TAG)
        if lead.startswith("{"):
            return skip
        if not final and PYTHON_TAG.startswith(lead):  # whitespace only, or the tag not whole yet
            return None
        return -1
