"""The router's KV index feed over real ZMQ sockets: a worker that restarts under the same name and
event endpoint loses its indexed blocks at once and is rebuilt from the new process's snapshot, and a
silent snapshot endpoint does not hold the index lock or stall the other workers' events."""

from __future__ import annotations

import time

import pytest

from pdserve.cache.kv_events import KVEventPublisher
from pdserve.router.kv_index_feed import IndexFeed


def _free_endpoint() -> str:
    from pdserve.bench.procs import free_port

    return f"tcp://127.0.0.1:{free_port()}"


def _until(pred, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("token", [None, "internal-tok"])
def test_a_restarted_worker_drops_its_stale_blocks_and_rebuilds_from_its_snapshot(token):
    """With the internal token the workers' event sockets take only its holders: the feed holds it."""
    events = _free_endpoint()
    feed = IndexFeed(token)
    first = KVEventPublisher(events, "w", "tcp://127.0.0.1:*", token=token)
    second = None
    try:
        first.stored(["a1", "a2", "a3"])
        feed.watch(first.endpoint, first.snapshot_endpoint, "w", (1, first.snapshot_endpoint))
        _until(lambda: feed.blocks_of("w") == 3, "the first process's blocks")
        first.close()
        # Same name and event endpoint, a new process: it holds one block, the old ones are gone.
        second = KVEventPublisher(events, "w", "tcp://127.0.0.1:*", token=token)
        second.stored(["b1"])
        feed.watch(second.endpoint, second.snapshot_endpoint, "w", (2, second.snapshot_endpoint))
        assert feed.blocks_of("w") in (0, 1)  # dropped at once, before any event arrives
        assert feed.restarts_seen == 1
        _until(lambda: feed.blocks_of("w") == 1, "the new process's snapshot")
        with feed.lock:
            assert set(feed.index.worker_blocks("w")) == {"b1"}
        # The same instance again changes nothing.
        feed.watch(second.endpoint, second.snapshot_endpoint, "w", (2, second.snapshot_endpoint))
        assert feed.restarts_seen == 1 and feed.blocks_of("w") == 1
    finally:
        feed.close()
        if second is not None:
            second.close()


def test_a_silent_snapshot_endpoint_does_not_hold_the_index():
    feed = IndexFeed()
    live = KVEventPublisher("tcp://127.0.0.1:*", "live", "tcp://127.0.0.1:*")
    try:
        # A worker whose snapshot endpoint never answers (nothing listens there).
        feed.watch(_free_endpoint(), _free_endpoint(), "silent", 1)
        feed.watch(live.endpoint, live.snapshot_endpoint, "live", 1)
        live.stored(["x"])
        _until(lambda: feed.blocks_of("live") == 1, "the live worker's snapshot")
        for i in range(20):  # the lock is never held across a network wait
            t0 = time.monotonic()
            with feed.lock:
                pass
            assert time.monotonic() - t0 < 1.0, i
            time.sleep(0.1)
        live.stored(["y"], parent="x")
        _until(lambda: feed.blocks_of("live") == 2, "the live worker's next event")
    finally:
        feed.close()
        live.close()


def test_a_worker_that_left_the_registry_is_no_longer_followed():
    """retain(): the subscriber of a worker no longer registered closes and its blocks leave the
    index; the others are kept; one registered again is followed again from its snapshot."""
    feed = IndexFeed()
    stay = KVEventPublisher("tcp://127.0.0.1:*", "stay", "tcp://127.0.0.1:*")
    gone = KVEventPublisher("tcp://127.0.0.1:*", "gone", "tcp://127.0.0.1:*")
    try:
        stay.stored(["s1"])
        gone.stored(["g1", "g2"])
        for p in (stay, gone):
            feed.watch(p.endpoint, p.snapshot_endpoint, p.worker_id, 1)
        _until(lambda: feed.blocks_of("stay") == 1 and feed.blocks_of("gone") == 2, "both snapshots")
        assert set(feed._subs) == {stay.endpoint, gone.endpoint}
        feed.retain({stay.endpoint})
        _until(lambda: set(feed._subs) == {stay.endpoint}, "the retired worker's subscriber closed")
        assert feed.blocks_of("gone") == 0 and feed.blocks_of("stay") == 1
        stay.stored(["s2"], parent="s1")
        _until(lambda: feed.blocks_of("stay") == 2, "the kept worker's next event")
        feed.retain({stay.endpoint})  # nothing else to drop: idempotent
        feed.watch(gone.endpoint, gone.snapshot_endpoint, gone.worker_id, 1)  # registered again
        _until(lambda: feed.blocks_of("gone") == 2, "the returning worker's snapshot")
    finally:
        feed.close()
        stay.close()
        gone.close()
