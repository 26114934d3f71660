"""qwen3_coder (Qwen3-Coder): each call an XML-like block, one parameter per tag,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The values are written bare, so their types are not in the text. With the tool's schema one would
read each as its declared type; the parser does not have it, so it guesses: a value that parses as
JSON other than a string (a number, true/false/null, an object, an array) is taken as that, and any
other value is the text itself (a quoted "x" stays with its quotes: the model wrote them)."""

from __future__ import annotations

import re
from typing import Any

from pdserve.common.tool_parsers._base import Tagged, loads

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
# A value ends at its closing tag; a model that leaves it out ends it at the next parameter.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _value(text: str) -> Any:
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    try:
        value = loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


class Qwen3Coder(Tagged):
    START, END = "<tool_call>", "</tool_call>"
    OPENS = "<function="

    def body(self, text: str) -> tuple[str, str] | None:
        function = _FUNCTION.fullmatch(text)
        if function is None:
            return None
        name, inner = function.group(1).strip(), function.group(2)
        args: dict[str, Any] = {}
        at = 0
        for param in _PARAMETER.finditer(inner):
            if inner[at : param.start()].strip():  # text between parameters: not this format
                return None
            args[param.group(1).strip()] = _value(param.group(2))
            at = param.end()
        if inner[at:].strip():
            return None
        arguments = self.arguments(name, args)
        return None if arguments is None else (name, arguments)
