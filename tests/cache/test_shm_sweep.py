"""Shared-memory files whose maker is gone (a worker killed with -9 skips its cleanup): a KV pool
(`pdserve-kv-<pid>-…`) or an EP rank group's mailboxes (`pdserve-ep-<pid>-…`) go when the next one
of their kind is made; a live process's files and other names stay."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.cache.kv_cache import SHM_DIR, allocate_kv_cache, new_shm_path
from pdserve.model import ep_shm
from pdserve.model.arch import TINY_CONFIGS
from pdserve.utils.shm import pid_alive, sweep_stale


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)
    return p.pid


def test_only_files_of_gone_processes_go(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    names = {
        "stale": f"pdserve-kv-{dead}-1a2b",
        "live": f"pdserve-kv-{live}-3c4d",
        "other_kind": f"pdserve-ep-{dead}-5e6f",
        "not_ours": f"pdserve-kv-{dead}-notahex",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    gone = sweep_stale(tmp_path, "pdserve-kv")
    assert [p.name for p in gone] == [names["stale"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "stale")
    assert sweep_stale(tmp_path / "missing", "pdserve-kv") == []


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_a_new_kv_pool_removes_a_killed_workers_pool():
    stale = SHM_DIR / f"pdserve-kv-{_dead_pid()}-{os.urandom(4).hex()}"
    stale.write_bytes(b"\0" * 4096)
    path = new_shm_path()
    try:
        allocate_kv_cache(TINY_CONFIGS["tiny-llama"], 2, 4, torch.float32, "cpu", path)
        assert not stale.exists() and path.exists()
    finally:
        path.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)


@pytest.mark.skipif(not ep_shm.available(), reason="no C compiler for kernels/shm_wait.c")
def test_new_mailboxes_remove_those_of_a_rank_0_killed_while_its_ranks_joined(tmp_path):
    stale = tmp_path / f"pdserve-ep-{_dead_pid()}-{os.urandom(4).hex()}"
    stale.write_bytes(b"\0" * 64)
    path = ep_shm.create(2, 1024, str(tmp_path))
    assert not stale.exists() and os.path.exists(path)
