"""What generation hands back per step, in the form it crosses processes (worker -> router)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # the top-k alternatives, best first

    def to_wire(self) -> list[Any]:
        """A msgpack/JSON-friendly list, for worker-to-worker and worker-to-router messages."""
        return [self.token_id, self.logprob, self.rank, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, entry: list[Any]) -> TokenLogprob:
        token_id, logprob, rank, top = entry
        return cls(int(token_id), float(logprob), int(rank), [(int(t), float(lp)) for t, lp in top])


@dataclass
class RequestOutput:
    """What one step produced for one request: a delta, plus the totals so far."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None  # finish_reason "error": why, for the client
    # First output of a decode-role request only: the prefill worker that filled its KV, and
    # those that failed to (see Request.prefill_attempts).
    prefilled_by: str | None = None
    prefill_failures: list[str] = field(default_factory=list)
    # First output only, when asked for: the prompt tokens' logprobs (None for the first token).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Last output only: when the engine first scheduled the request (time.monotonic()), for the
    # queue, prefill and decode times of server/vllm_metrics.py.
    scheduled_time: float | None = None
