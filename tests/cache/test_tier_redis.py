"""Remote tier against a real redis-server: two workers share blocks; Redis down means misses."""

from __future__ import annotations

import socket
import threading

import redis
import torch

from pdserve.cache.tiers.codec import encode_block
from pdserve.cache.tiers.manager import TieredKVStore
from pdserve.cache.tiers.redis_tier import RedisTier

L, BS, H, D = 2, 4, 2, 8
NUM_BLOCKS = 8
BLOCK_BYTES = L * 2 * BS * H * D * 4
WAIT = 10.0


def _kv(seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(L, 2, NUM_BLOCKS * BS, H, D)
    return torch.randn(L, 2, NUM_BLOCKS * BS, H, D, generator=torch.Generator().manual_seed(seed))


def _blk(kv: torch.Tensor, b: int) -> torch.Tensor:
    return kv[:, :, b * BS : (b + 1) * BS]


def _h(i: int) -> bytes:
    return bytes([0xA0 + i]) * 16


def _load(store: TieredKVStore, hashes: list[bytes], block_ids: list[int], kv: torch.Tensor) -> int:
    done = threading.Event()
    got: list[int] = []
    store.load_async(hashes, block_ids, kv, lambda n: (got.append(n), done.set()))
    assert done.wait(WAIT), "load did not finish"
    return got[0]


def test_two_workers_share_blocks_through_redis(redis_server, stores):
    worker_a = stores(host_bytes=8 * BLOCK_BYTES, remote=redis_server.url, remote_ttl_s=600)
    worker_b = stores(host_bytes=8 * BLOCK_BYTES, remote=redis_server.url, remote_ttl_s=600)
    src = _kv(1)
    hashes = [_h(i) for i in range(4)]
    for i, h in enumerate(hashes):
        worker_a.offload(h, _blk(src, i))
    assert worker_a.flush(WAIT)  # write-through: in Redis while A still holds them
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(k.decode() for k in client.keys("pdserve:kv:*"))
    assert keys == sorted(f"pdserve:kv:{h.hex()}" for h in hashes)
    assert 0 < client.ttl(keys[0]) <= 600

    assert worker_b.lookup(hashes + [_h(7)]) == 4
    dst = _kv(None)
    assert _load(worker_b, hashes, [4, 5, 6, 7], dst) == 4
    assert torch.equal(dst[:, :, 4 * BS :], src[:, :, : 4 * BS])
    s = worker_b.stats()
    assert s["tier_remote_hits"] == 4 and s["tier_remote_load_count"] == 4
    assert worker_a.stats()["tier_remote_bytes_written"] > 4 * BLOCK_BYTES

    # B evicting the same blocks later does not upload them again: it knows Redis has them.
    written = worker_b.stats()["tier_remote_bytes_written"]
    for i, h in enumerate(hashes):
        worker_b.offload(h, _blk(dst, 4 + i))
    assert worker_b.flush(WAIT)
    assert worker_b.stats()["tier_remote_bytes_written"] == written


def test_lookup_mixes_local_and_remote_blocks(redis_server, stores):
    a = stores(remote=redis_server.url)
    b = stores(host_bytes=8 * BLOCK_BYTES, remote=redis_server.url)
    src = _kv(2)
    a.offload(_h(1), _blk(src, 1))
    assert a.flush(WAIT)
    b.offload(_h(0), _blk(src, 0))
    b.offload(_h(2), _blk(src, 2))
    assert b.lookup([_h(i) for i in range(4)]) == 3
    assert b.lookup([_h(i) for i in range(4)], remote=False) == 1
    dst = _kv(None)
    assert _load(b, [_h(0), _h(1), _h(2)], [0, 1, 2], dst) == 3
    assert torch.equal(dst[:, :, : 3 * BS], src[:, :, : 3 * BS])


def test_corrupt_remote_value_is_a_miss_and_is_deleted(redis_server, stores):
    store = stores(remote=redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    good = encode_block(_h(0), _blk(_kv(3), 0))
    client.set(f"pdserve:kv:{_h(0).hex()}", good[:-1] + bytes([good[-1] ^ 1]))
    client.set(f"pdserve:kv:{_h(1).hex()}", encode_block(_h(2), _blk(_kv(3), 0)))  # another block's bytes
    assert _load(store, [_h(0)], [0], _kv(None)) == 0
    assert _load(store, [_h(1)], [0], _kv(None)) == 0
    assert client.exists(f"pdserve:kv:{_h(0).hex()}", f"pdserve:kv:{_h(1).hex()}") == 0
    assert store.stats()["tier_remote_corrupt"] == 2


def test_namespace_prefixes_the_keys(redis_server):
    tier = RedisTier(redis_server.url, namespace="m1")
    try:
        assert tier.put(_h(0), encode_block(_h(0), _blk(_kv(4), 0)))
        assert redis.Redis.from_url(redis_server.url).exists(f"pdserve:kv:m1:{_h(0).hex()}") == 1
        assert RedisTier(redis_server.url, namespace="m2").exists_many([_h(0)]) == [False]
    finally:
        tier.close()


def test_redis_never_there_means_misses_not_crashes(stores):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    store = stores(host_bytes=2 * BLOCK_BYTES, remote=url)
    store.remote.retry_after_s = 3600  # one failure, then quiet for the whole test
    src = _kv(5)
    store.offload(_h(0), _blk(src, 0))
    assert store.flush(WAIT)
    assert store.lookup([_h(0), _h(1)]) == 1  # the host copy still counts
    assert _load(store, [_h(1)], [1], _kv(None)) == 0
    dst = _kv(None)
    assert _load(store, [_h(0)], [0], dst) == 1 and torch.equal(_blk(dst, 0), _blk(src, 0))
    # It backed off after the first failure instead of trying (and timing out on) every block.
    assert store.stats()["tier_remote_errors"] == 1


def test_redis_dying_mid_run_means_misses_not_crashes(redis_server, stores):
    a = stores(remote=redis_server.url)
    b = stores(remote=redis_server.url)
    src = _kv(6)
    a.offload(_h(0), _blk(src, 0))
    assert a.flush(WAIT) and b.lookup([_h(0)]) == 1
    redis_server.stop()
    assert b.lookup([_h(0)]) == 0
    assert _load(b, [_h(0)], [0], _kv(None)) == 0
    a.offload(_h(1), _blk(src, 1))
    assert a.flush(WAIT)
    assert a.stats()["tier_remote_errors"] >= 1 and b.stats()["tier_remote_errors"] >= 1
