"""Prompts held at the router until a prefill worker can start them (router.hold_prefill).

A decode worker hands its request's prompt to the prefill worker the router named on arrival, and
the prompt then waits in that worker's queue however the pool changes: after a role switch adds a
prefill worker, the prompts already queued on the busy one stay there (benchmarks/autoscale.py lost
requests in its prompt phases so). Held here instead, a prompt is routed only once some prefill worker has
less than a step's budget (deployment.prefill.max_num_batched_tokens) of prompt tokens queued by the
router's own figures, so a new prefill worker takes the held prompts at once. Held prompts leave in
arrival order; one held longer than router.queue_timeout_s goes to the route it gets then.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable

from pdserve.router.accounting import Route

POLL_S = 0.01  # how often the head of the queue looks again (first tokens free room between steps)


class PrefillHold:
    def __init__(self, room_tokens: int, timeout_s: float) -> None:
        self.room_tokens = room_tokens
        self.timeout_s = timeout_s
        self._queue: deque[int] = deque()  # tickets of held prompts, oldest first
        self._tokens: dict[int, int] = {}  # ticket -> prompt tokens
        self._tickets = itertools.count()
        self.held_total = 0  # prompts ever held (for tests and logs)

    @property
    def held_tokens(self) -> int:
        """Prompt tokens held now: the controller counts them as the prefill pool's backlog."""
        return sum(self._tokens.values())

    def can_start(self, route: Route) -> bool:
        """The route's prompt would start within a step: no prefill worker in it, or the chosen one
        (the policy's least loaded) has room."""
        p = route.prefill
        return p is None or not route.remote_tokens or p.queued_prefill_tokens < self.room_tokens

    async def route(
        self, pick: Callable[[], tuple[Route | None, str]], tokens: int
    ) -> tuple[Route | None, str]:
        """`pick()`'s route once its prompt can start (or no route, or the timeout)."""
        route, reason = pick()
        if route is None or (not self._queue and self.can_start(route)):
            return route, reason
        ticket = next(self._tickets)
        self._queue.append(ticket)
        self._tokens[ticket] = tokens
        self.held_total += 1
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                await asyncio.sleep(POLL_S)
                late = time.monotonic() >= deadline
                if self._queue[0] != ticket and not late:
                    continue  # an older prompt goes first
                route, reason = pick()
                if route is None or late or self.can_start(route):
                    return route, reason
        finally:
            self._queue.remove(ticket)
            del self._tokens[ticket]
