"""deepseek_v3 (DeepSeek-V3, R1, V3.1): calls between DeepSeek's tool tokens, written with
full-width bars (U+FF5C) and U+2581 for spaces, as in DeepSeek's tokenizer_config and template:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                         (V3, R1)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>   (V3.1)

Several calls follow one another inside the section. The section's own tokens are dropped once a
call in it parses; while none has, they are held, and go back to content if none does."""

from __future__ import annotations

import re
from typing import Any

from pdserve.common.tool_parsers._base import Format, loads, skip_ws

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.S)


def _call(text: str) -> tuple[str, Any] | None:
    """(name, arguments) of the text between a call's begin and end tokens, either form."""
    kind, sep, rest = text.partition(SEP)
    if not sep:
        return None
    if kind.strip() == "function" and not rest.lstrip().startswith("{"):
        name, _, rest = rest.partition("\n")  # V3: the name after the separator, the arguments fenced
    else:
        name = kind  # V3.1: the name before the separator, the arguments bare
    fenced = _FENCE.fullmatch(rest)
    try:
        return name.strip(), loads(fenced.group(1) if fenced else rest)
    except ValueError:
        return None


class DeepSeekV3(Format):
    section = False  # inside the calls section (also entered by a call token with no section token)
    pending = ""  # the section's text while no call in it has parsed
    called = False  # a call in this section has parsed

    def step(self, final: bool) -> bool:
        if not self.section:
            found = self.scan((CALLS_BEGIN, CALL_BEGIN), final)
            if found is None:
                return False
            self.section, self.called = True, False
            self.pending = self.take(len(CALLS_BEGIN)) if found == CALLS_BEGIN else ""
            return True
        at = skip_ws(self.buf)
        rest = self.buf[at:]
        if rest.startswith(CALL_BEGIN):
            end = self.buf.find(CALL_END, at + len(CALL_BEGIN))
            if end < 0 and not final:
                return False
            call = _call(self.buf[at + len(CALL_BEGIN) : len(self.buf) if end < 0 else end])
            args = None if call is None else self.arguments(*call)
            text = self.take(len(self.buf) if end < 0 else end + len(CALL_END))
            if call is None or args is None:
                self.emit(self.pending + text)
            else:
                self.called = True
                self.add_call(call[0], args)
            self.pending = ""
            return True
        if rest.startswith(CALLS_END):
            text = self.take(at + len(CALLS_END))
            if not self.called:
                self.emit(self.pending + text)
            self.section, self.pending = False, ""
            return True
        if not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
            return False  # a token not whole yet, or only whitespace so far
        # Anything else ends the section; it is read again as content.
        if not self.called:
            self.emit(self.pending)
        self.section, self.pending = False, ""
        return True
