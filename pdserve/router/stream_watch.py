"""A worker's stream, read while watching the worker's health.

Across hosts a worker can go silent without closing anything: its link goes down (a partition:
no FIN, no reset reaches the router) or its process is stopped. The stream's socket then just
waits, and only the read timeout (`router.request_timeout_s`, long, since a long prompt may
legitimately keep a worker quiet) would end it. The registry's health checks and heartbeats see
such a worker within a few periods; a stream that stays silent while its worker is unhealthy is
given up so the router can retry or migrate the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable


class WorkerSilent(Exception):
    """The worker stopped answering its health checks while its stream was silent."""


_END = object()


async def watched(
    lines: AsyncIterator[str], healthy: Callable[[], bool], period_s: float
) -> AsyncGenerator[str, None]:
    """`lines` as they come; raises WorkerSilent once a period passes with no line and `healthy()`
    false. A pump task reads the lines and a watchdog task wakes once a period, so a line costs a
    queue hand-off (a task or a timer per line cost ~10x more). Close it (aclose) before closing
    the stream it reads: that stops both tasks."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    last = [loop.time()]

    async def pump() -> None:
        try:
            async for line in lines:
                last[0] = loop.time()
                q.put_nowait(line)
        except BaseException as e:  # noqa: BLE001 - the consumer raises it (a cancel only ends the pump)
            q.put_nowait(e)
            return
        q.put_nowait(_END)

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(period_s)
            if loop.time() - last[0] >= period_s and not healthy():
                q.put_nowait(WorkerSilent("the worker stopped answering health checks mid-stream"))
                return

    tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(watchdog())]
    try:
        while True:
            item = await q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # A consumer that stops at its last line (a finished request) leaves the body's end unread:
        # read it (briefly), so the connection goes back to the pool whole. A pump cancelled
        # mid-read left its connection neither pooled nor closed (CLOSE-WAIT once the worker
        # hung up), one per request.
        if not tasks[0].done():
            await asyncio.wait({tasks[0]}, timeout=0.5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
