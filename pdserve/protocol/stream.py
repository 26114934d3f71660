"""The NDJSON lines of `POST /internal/generate` (decode or mixed worker -> router).

Each engine output is one `TokenLine` (`encode()` on the worker, `from_wire(json.loads(line))` on the
router). A line with an "error" key instead is an `ErrorResponse` body (server/errors.py's
error_body) and ends the stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class TokenLine:
    token_ids: list[int]
    logprobs: list[list[Any]] | None  # TokenLogprob.to_wire() per token; None when not asked for
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int = 0
    # Only on the first line of a request a prefill worker was asked to fill: the bootstrap endpoint
    # of the one that filled the prompt (None: prefilled here) and of those that failed to.
    prefilled_by: str | None = None
    prefill_failed: list[str] | None = None
    # Only on the first line, when asked for: the prompt tokens' TokenLogprob.to_wire() (None first).
    prompt_logprobs: list[list[Any] | None] | None = None

    def to_wire(self) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finished": self.finished,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
        }
        if self.prefilled_by or self.prefill_failed:
            msg["prefilled_by"], msg["prefill_failed"] = self.prefilled_by, self.prefill_failed
        if self.prompt_logprobs is not None:
            msg["prompt_logprobs"] = self.prompt_logprobs
        return msg

    def encode(self) -> str:
        return json.dumps(self.to_wire()) + "\n"

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> TokenLine:
        """Raises KeyError for a line that lacks a required field."""
        return cls(
            msg["token_ids"],
            msg.get("logprobs"),
            msg["finished"],
            msg["finish_reason"],
            msg.get("num_prompt_tokens", 0),
            msg.get("prefilled_by"),
            msg.get("prefill_failed"),
            msg.get("prompt_logprobs"),
        )
