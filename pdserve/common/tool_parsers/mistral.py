"""mistral: calls after the [TOOL_CALLS] token, in one of the two forms Mistral's tokenizers use:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]    (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}       (v11 and later)

The newer form may carry a [CALL_ID] between the name and [ARGS] (Mistral's own id: pdserve gives
every call its own), and a detokenizer that drops control tokens leaves name{...} without [ARGS].
An array is all calls or none: one bad element gives the whole array back as content."""

from __future__ import annotations

import re

from pdserve.common.tool_parsers._base import Format, short_call_id, skip_ws

TOOL_CALLS = "[TOOL_CALLS]"
_HEADER = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?(?:\[ARGS\])?")
_HEADER_CHARS = re.compile(r"[A-Za-z0-9_.\-\[\]]*")


class Mistral(Format):
    inside = False  # buf starts with [TOOL_CALLS]
    new_id = staticmethod(short_call_id)  # its templates refuse any other id when a call comes back

    def step(self, final: bool) -> bool:
        if not self.inside:
            self.inside = self.scan((TOOL_CALLS,), final) is not None
            return self.inside
        decided = self._calls(final)
        if decided is None:
            return False
        self.inside = False
        if not decided:  # not calls: the marker is content, and what follows is read again
            self.emit(self.take(len(TOOL_CALLS)))
        return True

    def _calls(self, final: bool) -> bool | None:
        """True when calls were taken, False when what follows the marker is not a call, None when
        it cannot be told yet."""
        at = skip_ws(self.buf, len(TOOL_CALLS))
        if at == len(self.buf):
            return False if final else None
        if self.buf[at] == "[":
            got = self.decode_at(at)
            if got is None:
                return False if final else None
            calls = [self.from_object(obj) for obj in got[0]]
            if not calls or any(call is None for call in calls):
                return False
            self.take(got[1])
            for call in calls:
                assert call is not None
                self.add_call(*call)
            return True
        brace = self.buf.find("{", at)
        header = self.buf[at : len(self.buf) if brace < 0 else brace]
        if brace < 0:
            # A character no header can hold decides it early: plain text after the marker.
            return None if not final and _HEADER_CHARS.fullmatch(header) else False
        match = _HEADER.fullmatch(header)
        if match is None:
            return False
        got = self.decode_at(brace)
        if got is None:
            return False if final else None
        args = self.arguments(match.group(1), got[0])
        if args is None:
            return False
        self.take(got[1])
        self.add_call(match.group(1), args)
        return True
