"""TieredKVStore: host -> disk cascade, leading-prefix lookup, background loads into a KV tensor."""

from __future__ import annotations

import threading

import torch

from pdserve.cache.tiers.manager import TieredKVStore
from pdserve.config import CacheConfig

L, BS, H, D = 2, 4, 2, 8  # layers, block size, kv heads, head dim
NUM_BLOCKS = 12
BLOCK_BYTES = L * 2 * BS * H * D * 4
WAIT = 10.0


def _kv(seed: int | None = 0, dtype=torch.float32) -> torch.Tensor:
    """A KV tensor laid out as kv_cache.allocate_kv_cache does: [layers, 2, blocks * bs, heads, dim]."""
    if seed is None:
        return torch.zeros(L, 2, NUM_BLOCKS * BS, H, D, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NUM_BLOCKS * BS, H, D, generator=g).to(dtype)


def _blk(kv: torch.Tensor, b: int) -> torch.Tensor:
    return kv[:, :, b * BS : (b + 1) * BS]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _h(i: int) -> bytes:
    return bytes([i + 1]) * 16


class Done:
    """on_done for load_async, with a bounded wait."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)
        self.event.set()

    def wait(self) -> int:
        assert self.event.wait(WAIT), "load did not finish"
        return self.calls[-1]


def test_host_overflow_cascades_to_disk_and_everything_loads_back(tmp_path, stores):
    events = []
    store = stores(
        host_bytes=2 * BLOCK_BYTES,
        disk_dir=tmp_path,
        disk_bytes=1 << 20,
        listener=lambda kind, hs, tier: events.append((kind, [h[0] - 1 for h in hs], tier)),
    )
    src = _kv(1)
    for i in range(5):
        store.offload(_h(i), _blk(src, i))
    assert store.flush(WAIT)
    assert store.host.keys() == [_h(3), _h(4)]
    assert sorted(store.disk.keys()) == [_h(0), _h(1), _h(2)]
    assert ("removed", [0], "host") in events and ("stored", [0], "disk") in events
    assert events.index(("removed", [0], "host")) < events.index(("stored", [0], "disk"))
    assert store.lookup([_h(i) for i in range(5)]) == 5

    dst = _kv(None)
    done = Done()
    block_ids = [7, 0, 11, 3, 5]  # any destination ids, in any order
    store.load_async([_h(i) for i in range(5)], block_ids, dst, done)
    assert done.wait() == 5
    for i, b in enumerate(block_ids):
        assert _raw(_blk(dst, b)) == _raw(_blk(src, i))
    untouched = set(range(NUM_BLOCKS)) - set(block_ids)
    assert all(not _blk(dst, b).any() for b in untouched)
    s = store.stats()
    assert s["tier_host_hits"] == 2 and s["tier_disk_hits"] == 3
    assert s["tier_disk_load_count"] == 3 and s["tier_disk_load_seconds_sum"] > 0
    assert s["tier_host_evictions"] == 3 and s["tier_disk_bytes_written"] > 3 * BLOCK_BYTES
    assert s["tier_blocks_loaded"] == 5


def test_lookup_counts_only_the_leading_prefix(stores):
    store = stores(host_bytes=10 * BLOCK_BYTES)
    src = _kv(2)
    for i in (0, 1, 3):
        store.offload(_h(i), _blk(src, i))
    assert store.lookup([_h(i) for i in range(4)]) == 2
    assert store.lookup([_h(2), _h(3)]) == 0
    assert store.lookup([]) == 0


def test_a_corrupt_block_in_the_middle_ends_the_load_there(tmp_path, stores):
    store = stores(disk_dir=tmp_path, disk_bytes=1 << 20)  # no host tier: every block on disk
    src = _kv(3)
    hashes = [_h(i) for i in range(6)]
    for i, h in enumerate(hashes):
        store.offload(h, _blk(src, i))
    assert store.flush(WAIT)
    path = store.disk.path(hashes[3])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    dst = _kv(None)
    done = Done()
    store.load_async(hashes, list(range(6)), dst, done)
    assert done.wait() == 3
    for i in range(3):
        assert _raw(_blk(dst, i)) == _raw(_blk(src, i))
    assert not dst[:, :, 3 * BS :].any()  # nothing after the bad block is written
    assert not path.exists()
    assert store.lookup(hashes) == 3
    assert store.stats()["tier_disk_corrupt"] == 1


def test_a_missing_block_or_a_block_of_another_shape_ends_the_load(stores):
    store = stores(host_bytes=10 * BLOCK_BYTES)
    src = _kv(4)
    store.offload(_h(0), _blk(src, 0))
    store.offload(_h(2), _blk(src, 2))
    done = Done()
    store.load_async([_h(0), _h(1), _h(2)], [0, 1, 2], _kv(None), done)
    assert done.wait() == 1
    other = torch.zeros(L + 1, 2, NUM_BLOCKS * BS, H, D)  # another model's layout
    done = Done()
    store.load_async([_h(0)], [0], other, done)
    assert done.wait() == 0 and not other.any()


def test_bfloat16_blocks_round_trip_through_disk(tmp_path, stores):
    store = stores(disk_dir=tmp_path, disk_bytes=1 << 20)
    src = _kv(5, torch.bfloat16)
    store.offload(_h(0), _blk(src, 4))
    assert store.flush(WAIT)
    dst = _kv(None, torch.bfloat16)
    done = Done()
    store.load_async([_h(0)], [9], dst, done)
    assert done.wait() == 1 and _raw(_blk(dst, 9)) == _raw(_blk(src, 4))


def test_an_offloaded_block_is_always_findable_even_before_its_write(tmp_path, stores):
    store = stores(disk_dir=tmp_path, disk_bytes=1 << 20)
    src = _kv(6)
    hashes = [_h(i) for i in range(8)]
    for i, h in enumerate(hashes):
        store.offload(h, _blk(src, i))
        assert store.lookup(hashes[: i + 1]) == i + 1  # pending or on disk, never neither
    src.zero_()  # offload copied: the device may reuse blocks
    dst = _kv(None)
    done = Done()
    store.load_async(hashes, list(range(8)), dst, done)
    assert done.wait() == 8
    assert _raw(dst[:, :, : 8 * BS]) == _raw(_kv(6)[:, :, : 8 * BS])


def test_cancel_before_the_load_runs_means_no_write_and_no_callback(stores):
    store = stores(host_bytes=10 * BLOCK_BYTES)
    src = _kv(7)
    store.offload(_h(0), _blk(src, 0))
    gate = threading.Event()
    first = Done()

    def hold(n: int) -> None:  # runs on the loader thread: keeps it busy
        first(n)
        gate.wait(WAIT)

    store.load_async([_h(0)], [0], _kv(None), hold)
    assert first.wait() == 1
    dst = _kv(None)
    second = Done()
    ticket = store.load_async([_h(0)], [1], dst, second)
    assert store.cancel(ticket)
    gate.set()
    third = Done()
    store.load_async([_h(0)], [2], dst, third)  # the loader moved past the cancelled load
    assert third.wait() == 1
    assert second.calls == [] and not _blk(dst, 1).any()
    assert not store.cancel(ticket)  # gone
    assert store.stats()["tier_loads_cancelled"] == 1


def test_cancel_after_completion_reports_false(stores):
    store = stores(host_bytes=10 * BLOCK_BYTES)
    store.offload(_h(0), _blk(_kv(8), 0))
    done = Done()
    ticket = store.load_async([_h(0)], [0], _kv(None), done)
    assert done.wait() == 1
    assert not store.cancel(ticket)


def test_writes_past_the_queue_bound_are_dropped_not_blocking(tmp_path, stores):
    store = stores(disk_dir=tmp_path, disk_bytes=1 << 20, max_pending_bytes=BLOCK_BYTES - 1)
    store.offload(_h(0), _blk(_kv(9), 0))
    assert store.flush(WAIT)
    assert store.stats()["tier_write_drops"] == 1 and store.lookup([_h(0)]) == 0


def test_namespaces_keep_models_apart_on_a_shared_disk(tmp_path, stores):
    a = stores(disk_dir=tmp_path, disk_bytes=1 << 20, namespace="model-a")
    a.offload(_h(0), _blk(_kv(10), 0))
    assert a.flush(WAIT)
    b = stores(disk_dir=tmp_path, disk_bytes=1 << 20, namespace="model-b")
    a2 = stores(disk_dir=tmp_path, disk_bytes=1 << 20, namespace="model-a")  # a restarted worker
    assert b.lookup([_h(0)]) == 0 and a2.lookup([_h(0)]) == 1


def test_restarted_worker_reuses_and_announces_its_disk_blocks(tmp_path, stores):
    first = stores(disk_dir=tmp_path, disk_bytes=1 << 20)
    src = _kv(11)
    for i in range(3):
        first.offload(_h(i), _blk(src, i))
    assert first.flush(WAIT)
    first.close()
    events = []
    second = stores(disk_dir=tmp_path, disk_bytes=1 << 20, listener=lambda *e: events.append(e))
    assert events == [("stored", second.disk.keys(), "disk")] and len(events[0][1]) == 3
    dst = _kv(None)
    done = Done()
    second.load_async([_h(i) for i in range(3)], [0, 1, 2], dst, done)
    assert done.wait() == 3 and _raw(dst[:, :, : 3 * BS]) == _raw(src[:, :, : 3 * BS])


def test_from_config():
    assert TieredKVStore.from_config(CacheConfig()) is None
    store = TieredKVStore.from_config(CacheConfig(block_size=BS, host_cache_gb=0.001, load_timeout_s=2.5))
    try:
        assert store.host is not None and store.disk is None and store.remote is None
        assert store.host.budget_bytes == int(0.001 * (1 << 30)) and store.load_timeout_s == 2.5
    finally:
        store.close()


def test_a_load_past_its_deadline_stops_and_reports_what_it_has(stores):
    store = stores(host_bytes=10 * BLOCK_BYTES)
    src = _kv(12)
    store.offload(_h(0), _blk(src, 0))
    dst = _kv(None)
    done = Done()
    store.load_async([_h(0)], [0], dst, done, timeout=0.0)
    assert done.wait() == 0 and not dst.any()
    assert store.stats()["tier_loads_timed_out"] == 1


def test_a_block_bigger_than_the_host_tier_goes_straight_to_disk(tmp_path, stores):
    events = []
    store = stores(
        host_bytes=BLOCK_BYTES - 1,
        disk_dir=tmp_path,
        disk_bytes=1 << 20,
        listener=lambda kind, hs, tier: events.append((kind, tier)),
    )
    store.offload(_h(0), _blk(_kv(13), 0))
    assert store.flush(WAIT)
    assert len(store.host) == 0 and _h(0) in store.disk
    assert events == [("stored", "disk")]
