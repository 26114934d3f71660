"""A worker's stream, read while watching the worker's health.

Across hosts a worker can go silent without closing anything: its link goes down (a partition:
no FIN, no reset reaches the router) or its process is stopped. The stream's socket then just
waits, and only the read timeout (`router.request_timeout_s`, long, since a long prompt may
legitimately keep a worker quiet) would end it. The registry's health checks and heartbeats see
such a worker within a few periods; a stream that stays silent while its worker is unhealthy is
given up so the router can retry or migrate the request."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable


class WorkerSilent(Exception):
    """The worker stopped answering its health checks while its stream was silent."""


async def watched(lines: AsyncIterator[str], healthy: Callable[[], bool], period_s: float) -> AsyncIterator[str]:
    """`lines` as they come; raises WorkerSilent after a silence of at least `period_s` at whose
    end `healthy()` is false. The pending read is cancelled then (the caller closes the stream)."""
    it = lines.__aiter__()
    while True:
        nxt = asyncio.ensure_future(it.__anext__())
        try:
            while not (await asyncio.wait({nxt}, timeout=period_s))[0]:
                if not healthy():
                    raise WorkerSilent("the worker stopped answering health checks mid-stream")
        finally:
            if not nxt.done():
                nxt.cancel()
        try:
            line = nxt.result()
        except StopAsyncIteration:
            return
        yield line


async def unless_silent(aw, healthy: Callable[[], bool], period_s: float):
    """`aw`'s result (a request waiting for its response headers); WorkerSilent, `aw` cancelled,
    when a period ends unfinished with `healthy()` false."""
    task = asyncio.ensure_future(aw)
    try:
        while not (await asyncio.wait({task}, timeout=period_s))[0]:
            if not healthy():
                raise WorkerSilent("the worker stopped answering health checks before it replied")
    finally:
        if not task.done():
            task.cancel()
    return task.result()
