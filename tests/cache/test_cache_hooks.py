"""PrefixCache hooks: the event listener and on_evict, which runs before an evicted id is reused."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.prefix_cache import PrefixCache, prompt_hashes
from pdserve.cache.tiers.manager import TieredKVStore

BS = 4


def _insert_chain(cache: PrefixCache, pool: BlockPool, tokens: list[int]) -> tuple[list[bytes], list[int]]:
    hashes = prompt_hashes(tokens, BS)
    blocks = pool.allocate(len(hashes))
    for i, (h, b) in enumerate(zip(hashes, blocks)):
        assert cache.insert(h, hashes[i - 1] if i else None, b)
    return hashes, blocks


def test_listener_sees_stores_then_removals_leaf_first():
    seen = []
    cache = PrefixCache(BS, listener=lambda *e: seen.append(e))
    pool = BlockPool(4, cache)
    a, a_blocks = _insert_chain(cache, pool, list(range(8)))
    b, b_blocks = _insert_chain(cache, pool, [9] * 4)
    assert not cache.insert(a[0], None, 3)  # refused inserts say nothing
    assert seen == [("stored", a[0], None), ("stored", a[1], a[0]), ("stored", b[0], None)]
    seen.clear()
    pool.free(a_blocks)
    pool.free(b_blocks)
    pool.allocate(4)  # 1 free, then the LRU leaf a1; its parent a0 is now oldest, then b0
    assert seen == [("removed", a[1], a[0]), ("removed", a[0], None), ("removed", b[0], None)]
    pool.check_integrity()


def test_on_evict_runs_before_the_block_is_handed_out():
    calls = []
    cache = PrefixCache(BS)
    pool = BlockPool(2, cache)

    def on_evict(block_id: int, h: bytes) -> None:
        # Still cached and unreferenced, and not on the free list yet.
        assert cache.is_cached(block_id) and pool.refcount(block_id) == 0
        assert block_id not in pool._free
        calls.append((block_id, h))

    cache.on_evict = on_evict
    a, blocks = _insert_chain(cache, pool, list(range(8)))
    pool.free(blocks)
    got = pool.allocate(1)
    assert calls == [(blocks[1], a[1])] and got == [blocks[1]]
    pool.free(got)
    pool.check_integrity()


def test_a_failing_on_evict_leaves_the_cache_consistent():
    cache = PrefixCache(BS)
    pool = BlockPool(1, cache)
    a, blocks = _insert_chain(cache, pool, list(range(4)))
    pool.free(blocks)

    def boom(block_id: int, h: bytes) -> None:
        raise RuntimeError("offload failed")

    cache.on_evict = boom
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.check_integrity()
    assert cache.match(a) == blocks
    cache.on_evict = None
    assert pool.allocate(1) == blocks


def test_evicted_kv_survives_reuse_through_the_host_tier():
    """The engine's flow: offload on eviction, the device block is overwritten, then loaded back."""
    layers, heads, dim, num_blocks = 2, 2, 8, 3
    kv = torch.randn(layers, 2, num_blocks * BS, heads, dim, generator=torch.Generator().manual_seed(0))
    store = TieredKVStore(BS, host_bytes=1 << 20)
    try:
        cache = PrefixCache(BS, on_evict=lambda b, h: store.offload(h, kv[:, :, b * BS : (b + 1) * BS]))
        pool = BlockPool(num_blocks, cache)
        hashes, blocks = _insert_chain(cache, pool, list(range(3 * BS)))
        original = kv.clone()
        pool.free(blocks)
        reused = pool.allocate(num_blocks)  # evicts all three, leaves first
        kv.fill_(-1.0)  # a new request writes its own KV there
        assert cache.match(hashes) == []
        assert store.lookup(hashes) == 3
        pool.free(reused)
        dst = pool.allocate(3)
        done = threading.Event()
        got: list[int] = []
        store.load_async(hashes, dst, kv, lambda n: (got.append(n), done.set()))
        assert done.wait(10) and got == [3]
        for src_b, dst_b in zip(blocks, dst):
            assert torch.equal(
                kv[:, :, dst_b * BS : (dst_b + 1) * BS], original[:, :, src_b * BS : (src_b + 1) * BS]
            )
        pool.free(dst)
        pool.check_integrity()
    finally:
        store.close()
