"""The expert-parallel ranks' shared-memory all-to-all (model/ep_shm.py): rows arrive where gloo's
all-to-all puts them, messages past a mailbox's capacity go in chunks, and a silent or dead peer
fails the call (deadline; at once for a dead process) instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from gloo_ranks import in_threads

from pdserve.model import ep_shm

pytestmark = pytest.mark.skipif(not ep_shm.available(), reason="no C compiler for kernels/shm_wait.c")
TIMEOUT = timedelta(seconds=30)


def _ranks(world, capacity, fn):
    path = ep_shm.create(world, capacity)
    try:
        views = [ep_shm.ShmAllToAll(path, r, world, capacity) for r in range(world)]
        out = in_threads(world, lambda r: fn(r, views[r]), timeout=60)
        for v in views:
            v.close()
        return out
    finally:
        os.unlink(path)


@pytest.mark.parametrize("world,capacity", [(2, 1 << 20), (3, 1 << 20), (3, 200), (4, 64)])
def test_rows_arrive_as_an_all_to_all_puts_them(world, capacity):
    """Rank r sends (r + 1) * (d + 1) % 4 rows to rank d (some empty); with a 64-byte mailbox every
    message of more than one row goes in chunks. Three calls in a row reuse the mailboxes."""
    width = 5

    def rows(src, dst, call):
        n = (src + 1) * (dst + 1 + call) % 4
        return (
            torch.arange(n * width, dtype=torch.float32).view(n, width) + 1000 * src + 100 * dst + 10 * call
        )

    def fn(r, view):
        got = []
        for call in range(3):
            send = torch.cat([rows(r, d, call) for d in range(world)])
            out_splits = [rows(s, r, call).shape[0] for s in range(world)]
            in_splits = [rows(r, d, call).shape[0] for d in range(world)]
            got.append(view.all_to_all(send, out_splits, in_splits, TIMEOUT))
        return got

    res = _ranks(world, capacity, fn)
    for r in range(world):
        for call in range(3):
            assert torch.equal(res[r][call], torch.cat([rows(s, r, call) for s in range(world)]))


def test_int64_rows_and_one_dimensional_tensors():
    def fn(r, view):
        counts = view.all_to_all(torch.tensor([r * 10 + d for d in range(2)]), [1, 1], [1, 1], TIMEOUT)
        # Every rank sends 1 row to rank 0 and 2 to rank 1.
        out_splits = [1, 1] if r == 0 else [2, 2]
        meta = view.all_to_all(torch.full((3, 2), r, dtype=torch.int64), out_splits, [1, 2], TIMEOUT)
        return counts, meta

    res = _ranks(2, 1 << 16, fn)
    assert res[0][0].tolist() == [0, 10] and res[1][0].tolist() == [1, 11]
    assert res[0][1].tolist() == [[0, 0], [1, 1]]
    assert res[1][1].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


def test_a_silent_peer_fails_the_call_at_the_deadline():
    path = ep_shm.create(2, 1024)
    try:
        view = ep_shm.ShmAllToAll(path, 0, 2, 1024)
        ep_shm.ShmAllToAll(path, 1, 2, 1024).close()  # rank 1 joins (this process's pid) and never sends
        # The deadline's own message: the peer's process is alive (this one), only silent.
        with pytest.raises(ep_shm.PeerLost, match="did not answer"):
            view.all_to_all(torch.zeros(2, 3), [1, 1], [1, 1], timedelta(seconds=0.5))
        view.close()
    finally:
        os.unlink(path)


def test_a_dead_peer_fails_the_call_at_once():
    """Rank 1 is another process that joins and dies: the wait sees it gone (a zombie child included)
    long before the deadline."""
    path = ep_shm.create(2, 1024)
    try:
        view = ep_shm.ShmAllToAll(path, 0, 2, 1024)
        code = (
            "import sys; from pdserve.model import ep_shm; "
            f"ep_shm.ShmAllToAll({path!r}, 1, 2, 1024); print('joined', flush=True); sys.stdin.read()"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "joined"
            child.kill()  # not reaped yet: a zombie, as a killed rank is until rank 0 joins it
            # "is gone" comes only from the watch on the peer's process, never from the deadline.
            with pytest.raises(ep_shm.PeerLost, match="is gone"):
                view.all_to_all(torch.zeros(2, 3), [1, 1], [1, 1], timedelta(seconds=600))
        finally:
            child.kill()
            child.wait(10)
        view.close()
    finally:
        os.unlink(path)
