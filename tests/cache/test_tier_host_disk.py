"""Host and disk tiers: byte budgets, LRU order, atomic files, corruption, restart."""

from __future__ import annotations

import os

import torch

from pdserve.cache.tiers.codec import encode_block
from pdserve.cache.tiers.disk import DiskTier
from pdserve.cache.tiers.host import HostTier

SHAPE = (2, 2, 4, 2, 8)
NBYTES = 2 * 2 * 4 * 2 * 8 * 4


def _h(i: int) -> bytes:
    return bytes([i]) * 16


def _block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i))


def test_host_lru_eviction_spills_in_order():
    spilled = []
    host = HostTier(3 * NBYTES, spill=lambda h, t: spilled.append((h, t)))
    for i in range(3):
        assert host.put(_h(i), _block(i))
    assert host.get(_h(0)) is not None  # 0 becomes most recent: 1 is next out
    assert host.touch(_h(2))
    host.put(_h(3), _block(3))
    host.put(_h(4), _block(4))
    assert [h for h, _ in spilled] == [_h(1), _h(0)]
    assert torch.equal(spilled[0][1], _block(1))
    assert host.keys() == [_h(2), _h(3), _h(4)]
    assert host.used_bytes == 3 * NBYTES
    assert host.get(_h(1)) is None
    s = host.stats.as_dict("")
    assert (s["hits"], s["misses"], s["evictions"]) == (1, 1, 2)


def test_host_refuses_a_block_larger_than_its_budget():
    spilled = []
    host = HostTier(NBYTES - 1, spill=lambda h, t: spilled.append(h))
    assert not host.put(_h(0), _block(0))
    assert spilled == [] and len(host) == 0 and host.used_bytes == 0


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_disk_budget_lru_and_atomic_files(tmp_path):
    size = len(encode_block(_h(0), _block(0)))
    removed = []
    disk = DiskTier(tmp_path, 3 * size, on_remove=removed.extend)
    for i in range(3):
        assert disk.put(_h(i), encode_block(_h(i), _block(i)))
    assert disk.get(_h(0), shape=SHAPE, dtype=torch.float32) is not None  # 1 is now the oldest
    assert disk.put(_h(3), encode_block(_h(3), _block(3)))
    assert removed == [_h(1)]
    assert disk.keys() == [_h(2), _h(0), _h(3)]
    assert disk.used_bytes == 3 * size
    # One file per block, fanned out by the first byte of the hash, no temp files left.
    assert _files(tmp_path) == sorted(os.path.relpath(disk.path(h), tmp_path) for h in (_h(0), _h(2), _h(3)))
    assert all(f.endswith(".kv") for f in _files(tmp_path))
    assert torch.equal(disk.get(_h(3)), _block(3))
    assert disk.put(_h(3), b"ignored: already stored")  # a second put only refreshes the LRU
    assert torch.equal(disk.get(_h(3)), _block(3))


def test_disk_drops_corrupt_and_missing_files(tmp_path):
    removed = []
    disk = DiskTier(tmp_path, 1 << 20, on_remove=removed.extend)
    for i in range(3):
        disk.put(_h(i), encode_block(_h(i), _block(i)))
    path = disk.path(_h(1))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert disk.get(_h(1)) is None
    assert not path.exists() and _h(1) not in disk
    disk.path(_h(2)).unlink()  # deleted behind the tier's back
    assert disk.get(_h(2)) is None and _h(2) not in disk
    # A block filed under another block's name fails the hash check.
    disk.put(_h(5), encode_block(_h(0), _block(0)))
    assert disk.get(_h(5)) is None
    assert removed == [_h(1), _h(2), _h(5)]
    assert disk.stats.corrupt == 2
    assert torch.equal(disk.get(_h(0)), _block(0))


def test_disk_restart_rescans_in_mtime_order_and_cleans_temp_files(tmp_path):
    size = len(encode_block(_h(0), _block(0)))
    first = DiskTier(tmp_path, 10 * size)
    for i in range(4):
        first.put(_h(i), encode_block(_h(i), _block(i)))
        os.utime(first.path(_h(i)), (1_000_000 + i, 1_000_000 + (3 - i)))  # 3 oldest, 0 newest
    torn = first.path(_h(0)).parent / ".tmp-crashed"
    torn.write_bytes(b"half a block")
    (tmp_path / "README").write_text("not a block")
    second = DiskTier(tmp_path, 3 * size)  # smaller budget: the oldest file must go
    assert second.keys() == [_h(2), _h(1), _h(0)]
    assert not first.path(_h(3)).exists() and not torn.exists()
    assert second.used_bytes == 3 * size
    for i in range(3):
        assert torch.equal(second.get(_h(i), shape=SHAPE, dtype=torch.float32), _block(i))
