"""The router's watch on a worker's stream: lines pass through in order, a silence while the worker
fails its health checks ends the stream with WorkerSilent, a slow but healthy worker is waited for,
a read error reaches the reader, and closing the watch stops its tasks."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.stream_watch import WorkerSilent, unless_silent, watched


async def _lines(*items, pause: float = 0.0):
    for x in items:
        if pause:
            await asyncio.sleep(pause)
        if isinstance(x, Exception):
            raise x
        yield x


def test_lines_pass_and_a_slow_healthy_worker_is_waited_for():
    async def run():
        return [x async for x in watched(_lines("a", "b", "c", pause=0.15), lambda: True, 0.05)]

    assert asyncio.run(run()) == ["a", "b", "c"]


def test_silence_while_unhealthy_ends_the_stream():
    async def run():
        got = []
        with pytest.raises(WorkerSilent):
            async for x in watched(_lines("a", "b", pause=0.5), lambda: False, 0.05):
                got.append(x)
        return got

    assert asyncio.run(run()) == []


def test_a_read_error_reaches_the_reader_and_close_stops_the_tasks():
    async def run():
        with pytest.raises(ValueError, match="broken"):
            async for _ in watched(_lines("a", ValueError("broken")), lambda: True, 0.05):
                pass
        await asyncio.sleep(0)  # its cancelled tasks finish
        before = len(asyncio.all_tasks())
        w = watched(_lines("a", "b", pause=5), lambda: True, 0.05)
        assert await w.__anext__() == "a"
        assert len(asyncio.all_tasks()) == before + 2  # its reader and its watchdog
        await w.aclose()
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == before

    asyncio.run(run())


def test_a_reply_that_never_comes_from_an_unhealthy_worker():
    async def run():
        assert await unless_silent(asyncio.sleep(0.01, "ok"), lambda: False, 0.5) == "ok"
        with pytest.raises(WorkerSilent):
            await unless_silent(asyncio.sleep(10), lambda: False, 0.05)

    asyncio.run(run())
