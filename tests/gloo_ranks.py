"""Expert-parallel ranks as threads of the test process: one gloo group each over one in-memory store
(`run_ranks`), or whatever each rank needs (`in_threads`)."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.model.ep_protocol import Comm


def in_threads(world, fn, timeout: float = 120):
    """fn(rank) on `world` threads at once; returns each rank's result, raising any rank's error."""
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank is still running"
    return results


def run_ranks(world, fn):
    """fn(rank, comm), each rank with its own gloo group (loopback) over one in-memory store."""
    store = dist.HashStore()

    def rank(r):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=60)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, r, world, opts)
        return fn(r, Comm(pg, r, world, torch.device("cpu"), 60))

    return in_threads(world, rank)
