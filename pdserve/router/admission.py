"""The admission queue: at most `max_concurrent` requests at the workers, at most `max_queue` waiting.

A request that finds the queue full, or waits longer than the timeout, gets a 503 with
Retry-After: the router sheds load instead of growing without bound.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from pdserve.common import tracing
from pdserve.server.errors import APIError


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, timeout_s: float) -> None:
        self.max_concurrent, self.max_queue, self.timeout_s = max_concurrent, max_queue, timeout_s
        self.active = 0
        self.waiting = 0
        self.rejected = 0
        self._cond: asyncio.Condition | None = None

    @asynccontextmanager
    async def slot(self):
        if self._cond is None:
            self._cond = asyncio.Condition()
        cond = self._cond
        with tracing.span("router.queue", waiting=self.waiting):
            await self._wait(cond)
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            async with cond:
                cond.notify(1)

    async def _wait(self, cond: asyncio.Condition) -> None:
        if self.active >= self.max_concurrent:
            if self.waiting >= self.max_queue:
                self.rejected += 1
                raise APIError(
                    503,
                    "the router's queue is full; retry later",
                    code="overloaded",
                    headers={"Retry-After": "1"},
                )
            self.waiting += 1
            try:
                async with cond:
                    await asyncio.wait_for(
                        cond.wait_for(lambda: self.active < self.max_concurrent), self.timeout_s
                    )
            except asyncio.TimeoutError:
                self.rejected += 1
                raise APIError(
                    503,
                    f"no capacity within {self.timeout_s:.0f}s; retry later",
                    code="overloaded",
                    headers={"Retry-After": "2"},
                ) from None
            finally:
                self.waiting -= 1
