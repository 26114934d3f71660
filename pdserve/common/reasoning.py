"""Reasoning content: the text a reasoning model writes between <think> and </think>, returned apart
from the answer (`reasoning_content` beside `content`, as vLLM and SGLang return it), streamed too.

- deepseek_r1: the chat template opens the thinking, so the output is reasoning from its first
  token (a leading <think> is dropped) until </think>; with no </think>, all of it is reasoning.
- qwen3: reasoning only when the output opens with <think> (thinking can be off:
  chat_template_kwargs {"enable_thinking": false}), until </think> or the end.

One state machine serves both ways of answering: the whole text is fed once and finished, a stream
is fed delta by delta, so the streamed pieces always add up to the whole answer's. A tag split across
deltas is held back until it is whole."""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, kind: str) -> None:
        if kind not in PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}; known: {', '.join(PARSERS)}")
        self.kind = kind
        self.mode = "start"  # start -> reasoning -> content, or start -> content
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) this text adds, as far as can be told yet."""
        self.buf += text
        reasoning, content = "", ""
        if self.mode == "start":
            lead = self.buf.lstrip()
            if lead.startswith(START):
                self.buf, self.mode = lead[len(START) :], "reasoning"
            elif START.startswith(lead) and lead:
                return "", ""  # maybe the start tag, not whole yet
            elif not lead:
                return "", ""  # only whitespace so far
            else:
                self.mode = "reasoning" if self.kind == "deepseek_r1" else "content"
        if self.mode == "reasoning":
            at = self.buf.find(END)
            if at < 0:
                keep = _held(self.buf, END)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return reasoning, ""
            reasoning, self.buf, self.mode = self.buf[:at], self.buf[at + len(END) :], "content"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        rest, self.buf = self.buf, ""
        if self.mode == "start":  # the output was only whitespace, or a piece of the start tag
            return ("", rest) if self.kind == "qwen3" else (rest.lstrip(), "")
        return (rest, "") if self.mode == "reasoning" else ("", rest)


def split(kind: str, text: str) -> tuple[str, str]:
    """The whole output's (reasoning, content)."""
    p = ReasoningParser(kind)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return r1 + r2, c1 + c2
