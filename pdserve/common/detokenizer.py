"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

from pdserve.common.tokenizer import TokenizerWrapper


class IncrementalDetokenizer:
    """Decodes only a short window of tokens per step; holds back a partial UTF-8 character."""

    def __init__(
        self, tokenizer: TokenizerWrapper, skip_special_tokens: bool, stop: list[str], include_stop_str: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.include_stop_str = include_stop_str
        # Text that may still become the start of a stop string is not shown yet.
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the matched stop string when the text hit one."""
        self.tokens.append(token_id)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :], self.skip_special)
        if full.endswith("\ufffd"):
            return None
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if not new:
            return None
        start = max(0, len(self.text) - self.hold_back)
        self.text += new
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx >= 0:
                self.text = self.text[: idx + len(s)] if self.include_stop_str else self.text[:idx]
                return s
        return None

    def take(self, finished: bool) -> str:
        """The text not yet handed out, minus what a stop string might still claim."""
        end = (
            len(self.text)
            if finished or not self.stop
            else max(self.emitted, len(self.text) - self.hold_back)
        )
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


class NoText:
    """The detokenizer of a request that wants token ids only (SamplingParams.detokenize False)."""

    def add(self, token_id: int) -> str | None:
        return None

    def take(self, finished: bool) -> str:
        return ""
