"""The cache a core owns, read from sysfs (utils/cpu.py): caches shared with other cores never count."""

from __future__ import annotations

from pdserve.utils.cpu import core_cache_bytes


def _cpu(root, siblings, caches):
    cpu = root / "cpu0"
    if siblings is not None:
        (cpu / "topology").mkdir(parents=True)
        (cpu / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    for i, (size, shared) in enumerate(caches):
        index = cpu / "cache" / f"index{i}"
        index.mkdir(parents=True)
        (index / "size").write_text(size + "\n")
        (index / "shared_cpu_list").write_text(shared + "\n")
    return cpu


def test_the_largest_cache_no_other_core_shares(tmp_path):
    # A 2-core VM: L1 and L2 its own, the host socket's L3 listed as shared by both.
    vm = _cpu(tmp_path / "vm", "0", [("48K", "0"), ("64K", "0"), ("2048K", "0"), ("491520K", "0-1")])
    assert core_cache_bytes(cpu=vm) == 2 << 20
    # Two hardware threads a core share its L2; the L3 of 8 cores is not the core's.
    smt = _cpu(tmp_path / "smt", "0,8", [("32K", "0,8"), ("1024K", "0,8"), ("32768K", "0-7,8-15")])
    assert core_cache_bytes(cpu=smt) == 1 << 20
    # No topology: only a cache listed for this CPU alone.
    bare = _cpu(tmp_path / "bare", None, [("512K", "0"), ("16M", "0-3")])
    assert core_cache_bytes(cpu=bare) == 512 << 10


def test_the_default_where_sysfs_says_nothing(tmp_path):
    assert core_cache_bytes(123, cpu=tmp_path / "cpu0") == 123
    odd = _cpu(tmp_path / "odd", "0", [("lots", "0"), ("1M", "")])
    assert core_cache_bytes(7, cpu=odd) == 7
