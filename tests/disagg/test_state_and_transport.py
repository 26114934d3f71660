"""The pure parts of disaggregation: the transfer state machine, run coalescing, throttling, deploy config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.cache.kv_cache import allocate_kv_cache, new_shm_path, raw_bytes_view
from pdserve.config import load_config
from pdserve.disagg.state import Deadlines, InvalidTransition, Transfer, TransferState
from pdserve.disagg.transports import Throttle, coalesce, parse_bandwidth_limit
from pdserve.disagg.transports.shm import ShmWriter
from pdserve.launch import instance_counts
from pdserve.model.arch import TINY_CONFIGS

ROOT = Path(__file__).resolve().parents[2]


def test_happy_path_and_deadlines():
    t = Transfer("r", Deadlines(bootstrap_s=1, queue_s=10, transfer_s=2), now=0.0)
    assert t.state == TransferState.BOOTSTRAPPING and t.deadline == 1.0
    assert not t.expired(0.9) and t.expired(1.1)
    t.on("accepted", 0.5)
    assert t.state == TransferState.WAITING and t.deadline == 10.5
    t.on("started", 3.0)
    t.on("progress", 4.0)
    assert t.state == TransferState.TRANSFERRING and t.deadline == 6.0  # progress renews it
    t.on("done", 5.0)
    assert t.finished and t.deadline is None and not t.expired(1e9)
    assert t.history == [
        TransferState.BOOTSTRAPPING,
        TransferState.WAITING,
        TransferState.TRANSFERRING,
        TransferState.TRANSFERRING,
        TransferState.DONE,
    ]


def test_invalid_and_late_events():
    t = Transfer("r", Deadlines(), now=0.0)
    with pytest.raises(InvalidTransition):
        t.on("done", 0.1)  # nothing was accepted or started
    t.fail("peer died", 0.2)
    assert t.state == TransferState.FAILED and t.reason == "peer died"
    assert t.on("done", 0.3) == TransferState.FAILED  # late messages change nothing
    t.fail("again", 0.4)
    assert t.reason == "peer died"


def test_coalesce_runs():
    assert coalesce([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert coalesce([1, 2], [7, 9]) == [(1, 7, 1), (2, 9, 1)]
    assert coalesce([], []) == []


def test_bandwidth_limit_parsing_and_throttle():
    assert parse_bandwidth_limit(None, 1e10) is None
    assert parse_bandwidth_limit("25%", 8e9) == 2e9
    assert parse_bandwidth_limit(1e6, 8e9) == 1e6
    now = [0.0]  # a clock that moves only when the throttle sleeps
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    th = Throttle(1e6, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        th.consume(50_000)  # 250 kB at 1 MB/s: 0.25 s
    assert sum(slept) == pytest.approx(0.25) and len(slept) == 5
    now[0] += 10.0  # idle: the next burst is not owed to the past
    th.consume(50_000)
    assert len(slept) == 5
    th.consume(50_000)
    assert slept[-1] == pytest.approx(0.05)
    assert Throttle(None, sleep=sleep).consume(10**9) is None and len(slept) == 6


def test_shm_writer_copies_runs_between_pools_of_different_sizes():
    import torch

    arch = TINY_CONFIGS["tiny-llama"]
    src_t = allocate_kv_cache(arch, 8, 4, torch.float32)
    src_t.normal_()
    path = new_shm_path()
    dst_t = allocate_kv_cache(arch, 16, 4, torch.float32, "cpu", path)
    w = ShmWriter(raw_bytes_view(src_t), 4, str(path), list(dst_t.shape), 4)
    runs = coalesce([1, 2, 5], [10, 11, 3])
    for layer in range(arch.num_layers):
        w.write_layer("r", layer, runs)
    for s, d in ((1, 10), (2, 11), (5, 3)):
        assert torch.equal(dst_t[:, :, d * 4 : (d + 1) * 4], src_t[:, :, s * 4 : (s + 1) * 4])
    assert not dst_t[:, :, 0:4].any()  # untouched blocks stay as they were
    w.close()
    path.unlink()


def test_deploy_examples_and_counts():
    pd = load_config(ROOT / "examples" / "pd.yaml")
    assert pd.deployment.mode == "pd" and instance_counts(pd) == (1, 1)
    assert load_config(ROOT / "examples" / "mixed.yaml").deployment.mode == "mixed"
    assert instance_counts(load_config(None, {"deployment.pd_ratio": "1:3"})) == (1, 3)
    assert instance_counts(load_config(None, {"deployment.prefill.instances": 2})) == (2, 1)
    with pytest.raises(ValueError):
        instance_counts(load_config(None, {"deployment.pd_ratio": "two"}))


def test_raw_view_is_the_same_memory():
    import torch

    kv = torch.zeros(2, 2, 8, 1, 4, dtype=torch.bfloat16)
    raw = raw_bytes_view(kv)
    assert raw.shape == (2, 2, 8, 1, 8) and raw.dtype == np.uint8
    raw[1, 0, 3, 0, :] = 0xFF
    assert torch.isnan(kv[1, 0, 3, 0]).all()
