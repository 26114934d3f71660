"""The router's own figures of the work it sent to each worker and has not yet seen done.

The policies read them (WorkerState.in_flight, queued_prefill_tokens, decode_tokens), so each
worker must carry its own part: a request's decode worker its decode tokens and any prompt it
prefills itself, and the prefill worker that computes the prompt those tokens until the first
token comes back. Without the prefill worker's part every policy sees an idle prefill pool and
sends each uncached prompt to the same worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.registry import Worker


@dataclass
class Route:
    """A decode worker and the prefill worker named to it, picked as a pair for one attempt."""

    decode: Worker
    prefill: Worker | None  # sent as the decode worker's prefill peer (None: no prefill pool)
    remote_tokens: int = 0  # prompt tokens `prefill` is expected to compute (0: the decode worker does)


def remote_prefill_tokens(
    num_tokens: int, decode_hit: tuple[int, str] | None, block_size: int, local_prefill_max_tokens: int | None
) -> int:
    """The prompt tokens a decode worker will ask a prefill worker for: its uncached part, when
    that is long enough (the decode worker's own rule, engine.scheduler.wants_remote_prefill;
    a hit in any of its tiers counts as cached there too); 0 when it prefills the prompt itself."""
    cached = min(decode_hit[0] * block_size, max(num_tokens - 1, 0)) if decode_hit else 0
    uncached = num_tokens - cached
    if local_prefill_max_tokens is None or uncached < local_prefill_max_tokens:
        return 0
    return uncached


class Charge:
    """What one attempt adds to its workers' figures; each part is given back exactly once,
    however the attempt ends (finished, failed, aborted by the client)."""

    def __init__(self, route: Route, context: int, budget: int) -> None:
        d = route.decode
        self.decode = d
        self.prefill = route.prefill if route.remote_tokens else None
        self.local = 0 if self.prefill else context  # prompt tokens the decode worker computes
        self.remote = route.remote_tokens if self.prefill else 0
        self.budget, self.taken = budget, 0
        self.prefilled = self.closed = False
        d.in_flight += 1
        d.requests += 1
        d.queued_prefill_tokens += self.local
        d.decode_tokens += budget
        if self.prefill is not None:
            p = self.prefill
            p.in_flight += 1
            p.requests += 1
            p.queued_prefill_tokens += self.remote

    def first_token(self) -> None:
        """The prompt is prefilled: it leaves both queues, and the prefill worker's part is done."""
        if self.prefilled:
            return
        self.prefilled = True
        self.decode.queued_prefill_tokens -= self.local
        if self.prefill is not None:
            self.prefill.in_flight -= 1
            self.prefill.queued_prefill_tokens -= self.remote

    def generated(self, n: int) -> None:
        d = min(n, self.budget - self.taken)
        self.taken += d
        self.decode.decode_tokens -= d

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.first_token()
        self.decode.in_flight -= 1
        self.decode.decode_tokens -= self.budget - self.taken
        self.taken = self.budget
