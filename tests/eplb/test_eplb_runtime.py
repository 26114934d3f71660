"""Dispatch, trigger, recorder and metrics helpers of the expert balancer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.eplb import (
    BalancerMetrics,
    ExpertLoadRecorder,
    ImbalanceTrigger,
    dispatch,
    experts_moved,
    imbalance,
    log2phy,
    rank_load,
    replica_counts,
    sustained,
)

# ------------------------------------------------------------------ dispatch

PHY2LOG = torch.tensor([0, 1, 2, 3, 0, 0, 2, 1])  # expert 0 x3, 1 x2, 2 x2, 3 x1


def test_dispatch_maps_to_a_replica_of_the_right_expert():
    ids = torch.randint(0, 4, (50, 2), generator=torch.Generator().manual_seed(0))
    slots = dispatch(ids, PHY2LOG)
    assert slots.shape == ids.shape
    assert torch.equal(PHY2LOG[slots], ids)


def test_dispatch_spreads_evenly_and_is_deterministic():
    ids = torch.randint(0, 4, (97, 2), generator=torch.Generator().manual_seed(1))
    slots = dispatch(ids, PHY2LOG)
    assert torch.equal(slots, dispatch(ids, PHY2LOG))
    per_slot = torch.bincount(slots.reshape(-1), minlength=8)
    for e in range(4):
        mine = per_slot[PHY2LOG == e]
        assert mine.max() - mine.min() <= 1, f"expert {e}: {mine.tolist()}"


def test_dispatch_offset_rotates_the_first_replica():
    ids = torch.tensor([[0]])
    picks = {int(dispatch(ids, PHY2LOG, offset=k)) for k in range(3)}
    assert picks == {0, 4, 5}


def test_dispatch_with_prebuilt_table_and_errors():
    table = log2phy(PHY2LOG, 5)  # expert 4 has no replica
    assert table[1].tolist() == [3, 2, 2, 1, 0]
    assert table[0][0].tolist() == [0, 4, 5]
    ids = torch.tensor([[3, 1]])
    assert torch.equal(dispatch(ids, table=table), dispatch(ids, PHY2LOG))
    with pytest.raises(ValueError):
        dispatch(torch.tensor([[4]]), table=table)
    assert dispatch(torch.empty(0, 2, dtype=torch.long), PHY2LOG).shape == (0, 2)


# ------------------------------------------------------------------ trigger


def test_sustained():
    assert not sustained([2.0, 2.0], 1.5, 3)
    assert sustained([1.0, 2.0, 2.0, 2.0], 1.5, 3)
    assert not sustained([2.0, 1.0, 2.0], 1.5, 3)


def test_trigger_fires_only_after_a_sustained_window():
    trig = ImbalanceTrigger(threshold=1.2, window=3)
    readings = [1.5, 1.5, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5]
    fired = [trig.observe(x) for x in readings]
    assert fired == [False, False, False, False, False, True, False, False]


def test_trigger_ignores_spikes_and_honours_cooldown():
    trig = ImbalanceTrigger(threshold=1.2, window=2, cooldown=3)
    assert not any(trig.observe(x) for x in [3.0, 1.0] * 10)  # spikes never sustained
    fired = [trig.observe(2.0) for _ in range(8)]
    # Fires at the 2nd reading, then 3 quiet readings, then needs 2 more.
    assert fired == [False, True, False, False, False, False, True, False]


def test_trigger_with_synthetic_loads():
    R, P = 4, 8
    place = torch.arange(P).remainder(8).unsqueeze(0)  # one replica each
    trig = ImbalanceTrigger(threshold=1.3, window=4)
    even = torch.ones(1, 8)
    hot = torch.tensor([[10.0, 1, 1, 1, 1, 1, 1, 1]])
    seq = [even] * 5 + [hot] * 5
    fired = [trig.observe(imbalance(rank_load(x, place, R))) for x in seq]
    assert fired.index(True) == 8 and fired.count(True) == 1


# ------------------------------------------------------------------ recorder


def test_recorder_sliding_window():
    rec = ExpertLoadRecorder(num_layers=2, num_experts=4, window=3)
    rec.record(0, torch.tensor([[0, 1], [0, 2]]))
    rec.record(1, torch.tensor([3, 3]))
    assert rec.heatmap().tolist() == [[2, 1, 1, 0], [0, 0, 0, 2]]
    rec.advance()
    rec.record_counts(torch.ones(2, 4, dtype=torch.long))
    rec.advance()
    rec.advance()  # the first step leaves the window now
    assert rec.heatmap().tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    rec.advance()
    assert rec.heatmap().sum() == 0
    with pytest.raises(ValueError):
        rec.record(0, torch.tensor([4]))


def test_recorder_exports_dict_and_prometheus():
    rec = ExpertLoadRecorder(num_layers=1, num_experts=3, window=4)
    rec.record(0, torch.tensor([2, 2, 1]))
    rec.advance()
    d = json.loads(json.dumps(rec.to_dict()))
    assert d["counts"] == [[0, 1, 2]] and d["total"] == [3] and d["steps_in_window"] == 1
    reg = CollectorRegistry()
    rec.register_metrics(reg)
    text = generate_latest(reg).decode()
    assert 'pdserve_eplb_expert_activations{expert="2",layer="0"} 2.0' in text


def test_balancer_metrics():
    reg = CollectorRegistry()
    m = BalancerMetrics(reg)
    m.set_rank_load(torch.tensor([[3.0, 1.0]]))
    m.observe_rebalance(before=1.5, after=1.05, moved=7, seconds=0.01)
    assert reg.get_sample_value("pdserve_eplb_rank_load", {"rank": "0"}) == 3.0
    assert reg.get_sample_value("pdserve_eplb_imbalance") == 1.5
    assert reg.get_sample_value("pdserve_eplb_experts_moved_total") == 7
    assert reg.get_sample_value("pdserve_eplb_imbalance_after") == 1.05


# ------------------------------------------------------------------ metric helpers


def test_rank_load_and_imbalance():
    load = torch.tensor([[4.0, 2.0, 2.0]])
    phy2log = torch.tensor([[0, 1, 0, 2]])  # rank 0: {0, 1}, rank 1: {0, 2}
    rl = rank_load(load, phy2log, 2)
    assert rl.tolist() == [[4.0, 4.0]] and rl.sum() == load.sum()
    assert imbalance(rl) == 1.0
    assert imbalance(torch.tensor([[3.0, 1.0], [1.0, 1.0]])) == pytest.approx(4 / 3)
    assert replica_counts(phy2log, 3).tolist() == [[2, 1, 1]]


def test_experts_moved_ignores_order_within_a_rank():
    a = torch.tensor([[0, 1, 2, 3]])
    assert experts_moved(a, torch.tensor([[1, 0, 3, 2]]), 2) == 0
    assert experts_moved(a, torch.tensor([[2, 1, 0, 3]]), 2) == 2


def test_benchmark_prints_one_json_line():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "eplb.py"), "--quick", "--seeds", "1"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert set(d["nodes1"]) == {"zipf", "drift", "coding"}
    assert {"none", "greedy", "ours"} <= set(d["nodes1"]["zipf"])
