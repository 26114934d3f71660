"""Expert-parallel ranks as threads of the test process: one gloo group each, over one in-memory store."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.model.ep_protocol import Comm


def run_ranks(world, fn):
    """fn(rank, comm) on `world` threads; returns each rank's result, raising any rank's error."""
    store = dist.HashStore()
    results, errors = [None] * world, []

    def body(rank):
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=60)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(store, rank, world, opts)
            results[rank] = fn(rank, Comm(pg, rank, world, torch.device("cpu"), 60))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results
