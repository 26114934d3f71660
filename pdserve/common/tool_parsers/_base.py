"""What every tool-call format shares: the call and delta types, and the state machine's base.

A format reads `buf` (the output not yet decided) from its start and consumes what it can decide:
text that is content, a call, or text that looked like a call but is not one (it goes back to
content, so a model that writes something call-shaped loses no text). What cannot be decided yet
(a marker cut across deltas, a call whose end has not arrived) stays in `buf`. Decisions depend only
on the text, never on where the deltas were cut, so a stream adds up to the whole answer."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

_ID_CHARS = string.ascii_letters + string.digits


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: json.dumps would write them back unparseable


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def loads(text: str) -> Any:
    """Strict JSON (no NaN or Infinity); ValueError when it does not parse."""
    return _DECODER.decode(text)


def make_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def short_call_id() -> str:
    """Nine letters and digits: the only ids Mistral's chat templates take back in a conversation."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


@dataclass
class ToolCall:
    """One complete call, as the non-streamed message lists it."""

    id: str
    name: str
    arguments: str  # a JSON object, json.dumps(args, ensure_ascii=False)


@dataclass
class ToolCallDelta:
    """One streamed piece of a call, in OpenAI's chunk shape."""

    index: int
    id: str | None = None  # the first delta of a call only
    name: str | None = None  # the first delta of a call only
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        function: dict[str, Any] = {}
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


def held(text: str, markers: Iterable[str]) -> int:
    """How many trailing characters of `text` could be the start of one of `markers`."""
    most = 0
    for tag in markers:
        for n in range(min(len(tag) - 1, len(text)), most, -1):
            if tag.startswith(text[-n:]):
                most = n
                break
    return most


def skip_ws(text: str, at: int = 0) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def decode_json(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at `at` and where it ends, or None when it does not parse (yet).
    Only objects and arrays are read this way: their end is their closing bracket, so a value that
    parses from a prefix of the output parses the same from the whole of it."""
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError:
        return None


class Format:
    """One output's state machine. Subclasses implement step(); the driver calls it until it
    returns False (nothing more can be decided), and with final=True it must consume everything."""

    def __init__(self, tool_names: Collection[str] | None) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.out_content: list[str] = []
        self.out_deltas: list[ToolCallDelta] = []
        # Content that is whitespace only so far is held: with calls, an answer whose content is only
        # whitespace has content None, and the stream must add up to that.
        self._ws = ""
        self._shown = False
        self._undecoded: tuple[int, int] | None = None  # (at, len(buf)) when decode_at last failed

    def step(self, final: bool) -> bool:
        raise NotImplementedError

    @staticmethod
    def new_id() -> str:
        return make_call_id()

    # -- what subclasses emit

    def emit(self, text: str) -> None:
        if not text:
            return
        if self._shown:
            self.out_content.append(text)
            return
        self._ws += text
        if self._ws.strip():
            self.out_content.append(self._ws)
            self._ws, self._shown = "", True

    def take(self, n: int) -> str:
        text, self.buf = self.buf[:n], self.buf[n:]
        self._undecoded = None
        return text

    def decode_at(self, at: int) -> tuple[Any, int] | None:
        """decode_json of `buf` at `at`. A value can only have become whole at a closing bracket, so
        without one since the last try there it is not tried again: a long call streamed in small
        deltas is parsed a few times, not once a delta."""
        if self._undecoded is not None and self._undecoded[0] == at:
            new = self.buf[self._undecoded[1] :]
            if "}" not in new and "]" not in new:
                return None
        got = decode_json(self.buf, at)
        self._undecoded = None if got is not None else (at, len(self.buf))
        return got

    def scan(self, markers: tuple[str, ...], final: bool) -> str | None:
        """Emits content up to the first of `markers` and returns that marker, left at the start of
        `buf`; or, with no marker whole yet, emits all but what could be the start of one."""
        first, found = -1, None
        for tag in markers:
            at = self.buf.find(tag)
            if at >= 0 and (first < 0 or at < first):
                first, found = at, tag
        if found is not None:
            self.emit(self.take(first))
            return found
        keep = 0 if final else held(self.buf, markers)
        self.emit(self.take(len(self.buf) - keep))
        return None

    def arguments(self, name: Any, args: Any) -> str | None:
        """The arguments string of a call to `name` with `args`, or None when it is not a call: the
        name is not a known tool, or the arguments are not a JSON object (a string holding one is
        taken: some models quote their arguments)."""
        if (
            not isinstance(name, str)
            or not name
            or (self.tool_names is not None and name not in self.tool_names)
        ):
            return None
        if isinstance(args, str):
            try:
                args = loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return json.dumps(args, ensure_ascii=False)

    def from_object(self, obj: Any, need_args: bool = False) -> tuple[str, str] | None:
        """(name, arguments) of a {"name": ..., "arguments" or "parameters": {...}} object; a call with
        no arguments key takes {} unless `need_args` (where nothing but the object's shape tells a
        call from an answer that happens to be JSON)."""
        if not isinstance(obj, dict):
            return None
        key = "arguments" if "arguments" in obj else "parameters"
        if key not in obj and need_args:
            return None
        args = self.arguments(obj.get("name"), obj.get(key, {}))
        return None if args is None else (obj["name"], args)

    def add_call(self, name: str, arguments: str) -> None:
        call = ToolCall(id=self.new_id(), name=name, arguments=arguments)
        self.out_deltas.append(
            ToolCallDelta(index=len(self.calls), id=call.id, name=name, arguments=arguments)
        )
        self.calls.append(call)

    # -- the driver

    def run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        while self.step(final):
            pass
        if final:
            if self.buf:  # a format that left text undecided at the end: it is content
                self.emit(self.take(len(self.buf)))
            if self._ws and not self.calls:
                self.out_content.append(self._ws)
                self._ws = ""
        content, deltas = "".join(self.out_content), self.out_deltas
        self.out_content, self.out_deltas = [], []
        return content, deltas


class Tagged(Format):
    """Calls written between a start and an end tag, each on its own (hermes, qwen3_coder). A call
    the output ends inside of (no end tag) is read from what there is. One that does not parse
    gives back its start tag as content, and the text after it is read again: a real call may
    follow inside it."""

    START = ""
    END = ""

    OPENS = ""  # what a call's text starts with after whitespace
    inside = False  # buf starts with START

    def body(self, text: str) -> tuple[str, str] | None:
        """(name, arguments) of the text between the tags, or None when it is not a call."""
        raise NotImplementedError

    def hopeless(self, text: str) -> bool:
        """Whether the text after the start tag so far can be the start of no call (a model that
        writes the tag in prose): then its text need not wait for an end tag that may never come.
        Any text that begins so, or is cut shorter by an end tag, fails body() too."""
        lead = text.lstrip()
        return not (lead.startswith(self.OPENS) or self.OPENS.startswith(lead))

    def step(self, final: bool) -> bool:
        if not self.inside:
            self.inside = self.scan((self.START,), final) is not None
            return self.inside
        end = self.buf.find(self.END, len(self.START))
        stop = len(self.buf) if end < 0 else end
        if end < 0 and not final:
            if not self.hopeless(self.buf[len(self.START) :]):
                return False
            call = None
        else:
            call = self.body(self.buf[len(self.START) : stop])
        self.inside = False
        if call is None:
            self.emit(self.take(len(self.START)))
            return True
        self.take(stop if end < 0 else end + len(self.END))
        self.add_call(*call)
        return True


class JsonSequence(Format):
    """Calls as JSON objects one after another from the start of the output (llama3_json, json):
    an opening, objects with separators between, perhaps a closing, then whatever text follows.
    The structure's own text (opening, separators) is held while no call has parsed, and goes back
    to content if none does; the first object that is not a call ends the calls, and it and the
    text after it are content."""

    SEPARATORS = ""  # characters between two objects
    BARE = False  # objects may also follow one another with only whitespace between
    CLOSE = ""  # the character that ends the calls, if the format has one
    NEED_ARGS = False  # see Format.from_object
    mode = "start"  # start -> element <-> between -> content, or start -> content
    pending = ""

    def opening(self, final: bool) -> int | None:
        """How long the opening is (0 or more), -1 when the output does not open with calls, None
        when it cannot be told yet."""
        raise NotImplementedError

    def step(self, final: bool) -> bool:
        if self.mode == "start":
            n = self.opening(final)
            if n is None:
                return False
            if n < 0:
                self.mode = "content"
            else:
                self.pending, self.mode = self.take(n), "element"
            return True
        if self.mode == "content":
            self.emit(self.pending + self.take(len(self.buf)))
            self.pending = ""
            return False
        at = skip_ws(self.buf)
        if at == len(self.buf):
            if not final:
                return False
            if self.calls:  # a trailing separator or whitespace after the calls
                self.take(len(self.buf))
                self.pending = ""
            self.mode = "content"
            return True
        if self.mode == "between":
            mark = self.buf[at]
            if mark in self.SEPARATORS or (mark == "{" and self.BARE):
                self.pending += self.take(at + (mark != "{"))
                self.mode = "element"
            elif mark == self.CLOSE:
                self.take(at + 1)
                self.mode = "content"
            else:
                self.mode = "content"  # text after the calls
            return True
        if self.buf[at] != "{":
            self.mode = "content"
            return True
        got = self.decode_at(at)
        if got is None:
            if not final:
                return False
            self.mode = "content"
            return True
        call = self.from_object(got[0], self.NEED_ARGS)
        if call is None:
            self.mode = "content"
            return True
        self.take(got[1])
        self.pending, self.mode = "", "between"
        self.add_call(*call)
        return True
