"""Dispatch, trigger, recorder and metrics helpers of the expert balancer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.eplb import (
    BalancerMetrics,
    ExpertLoadRecorder,
    ImbalanceTrigger,
    dispatch,
    dispatch_by_load,
    experts_moved,
    imbalance,
    log2phy,
    rank_load,
    replica_counts,
    sustained,
)
from pdserve.eplb.dispatch import own_tokens, slot_owner

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


def _greedy_reference(ids: torch.Tensor, phy2log: torch.Tensor, ranks: int) -> torch.Tensor:
    """dispatch_by_load's rule, one choice at a time: single-slot experts first, then each replicated
    expert's choices in batch order to the replica on the least-loaded rank, ties to the lower slot."""
    p = phy2log.numel()
    owner = [next(r for r in range(ranks) if s < (r + 1) * p // ranks) for s in range(p)]
    reps = {e: [s for s in range(p) if int(phy2log[s]) == e] for e in set(phy2log.tolist())}
    flat, out, load = ids.reshape(-1).tolist(), [0] * ids.numel(), [0] * ranks
    for i, e in enumerate(flat):
        if len(reps[e]) == 1:
            out[i] = reps[e][0]
            load[owner[out[i]]] += 1
    for e in sorted({e for e in flat if len(reps[e]) > 1}):
        for i in [i for i, x in enumerate(flat) if x == e]:
            out[i] = min(reps[e], key=lambda s: (load[owner[s]], s))
            load[owner[out[i]]] += 1
    return torch.tensor(out).reshape(ids.shape)


def test_dispatch_by_load_prefers_the_replica_on_the_idle_rank():
    # 2 ranks, 3 slots each. Expert 0 has a replica on each rank; rank 0 also holds the single slots
    # of experts 1 and 2, which this batch loads with 6 choices, rank 1 holds expert 3 (1 choice).
    phy2log = torch.tensor([0, 1, 2, 0, 3, 4])
    ids = torch.tensor([[1, 2], [1, 2], [1, 2], [3, 0], [0, 4], [0, 1], [0, 2], [0, 3]])
    slots = dispatch_by_load(ids, log2phy(phy2log, 5), 2)
    assert torch.equal(phy2log[slots], ids)
    loads = torch.bincount(slot_owner(6, 2)[slots.reshape(-1)], minlength=2).tolist()
    # Rank 0 starts at 8 (experts 1, 2), rank 1 at 3 (experts 3, 4): expert 0's five choices fill
    # rank 1 up to rank 0's level (5 there), and round robin would put two or three on rank 0.
    assert loads == [8, 8]
    assert torch.equal(slots, _greedy_reference(ids, phy2log, 2))
    rr = torch.bincount(slot_owner(6, 2)[dispatch(ids, phy2log).reshape(-1)], minlength=2).tolist()
    assert max(rr) > max(loads)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_dispatch_by_load_matches_the_greedy_rule_and_is_deterministic(ranks):
    g = torch.Generator().manual_seed(ranks)
    phy2log = torch.cat([torch.arange(6), torch.tensor([0, 0, 2, 5, 1, 0])])[torch.randperm(12, generator=g)]
    table = log2phy(phy2log, 6)
    for t in (1, 7, 40):
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])
        ids[: t // 2, 0] = 0  # a hot expert
        slots = dispatch_by_load(ids, table, ranks)
        assert torch.equal(slots, dispatch_by_load(ids.clone(), log2phy(phy2log.clone(), 6), ranks))
        assert torch.equal(phy2log[slots], ids)
        assert torch.equal(slots, _greedy_reference(ids, phy2log, ranks))
    assert dispatch_by_load(torch.empty(0, 2, dtype=torch.long), table, ranks).shape == (0, 2)
    with pytest.raises(ValueError):
        dispatch_by_load(torch.tensor([[5, 6]]), log2phy(phy2log, 7), ranks)


def test_dispatch_by_load_ties_go_to_the_lower_slot():
    phy2log = torch.tensor([0, 1, 0, 1])  # 2 ranks: slots 0, 1 on rank 0, slots 2, 3 on rank 1
    slots = dispatch_by_load(torch.tensor([[0], [0], [0]]), log2phy(phy2log, 2), 2)
    assert slots.reshape(-1).tolist() == [0, 2, 0]
    # One rank: both replicas tie on every choice, so the lower slot takes them all.
    assert dispatch_by_load(torch.tensor([[1], [1]]), log2phy(phy2log, 2), 1).reshape(-1).tolist() == [1, 1]


def test_own_tokens_split_the_batch():
    for t in (0, 1, 5, 16):
        for world in (1, 2, 3, 4):
            parts = [own_tokens(t, r, world) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == t
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


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


# ------------------------------------------------------------------ global counts


def test_balancer_load_is_the_sum_of_each_rank_s_own_counts():
    """Two ranks joined by the expert-parallel channel (gloo over loopback, in two threads) count the
    choices of different tokens; the balancer's heatmap is their sum, not rank 0's share."""
    from pdserve.eplb.balancer import ExpertBalancer
    from pdserve.eplb.recorder import StepCounts

    layers, experts = [1, 3], 6
    g = torch.Generator().manual_seed(7)
    # Replicated attention: both ranks route one batch and each counts its half. Data-parallel
    # attention: each rank routes its own batch (a one-rank split owns all of it).
    shared = torch.randint(0, experts, (9, 2), generator=g)
    own = [torch.randint(0, 3, (5, 2), generator=g), torch.randint(3, experts, (11, 2), generator=g)]
    want = torch.zeros(2, experts, dtype=torch.long)
    for j in range(2):
        want[j] += torch.bincount(shared.reshape(-1), minlength=experts)
        want[j] += sum(torch.bincount(b.reshape(-1), minlength=experts) for b in own)
    balancer = ExpertBalancer(layers, experts, torch.arange(experts).repeat(2, 1), 2, interval=0)

    def rank(r: int, comm):
        replicated, mine = StepCounts(layers, experts, r, 2), StepCounts(layers, experts)
        for layer in layers:
            replicated.record(layer, shared)
            mine.record(layer, own[r])
        return comm.all_reduce(replicated.take() + mine.take())

    got = run_ranks(2, rank)
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    balancer.record_counts(got[0])
    balancer.end_step()
    assert balancer.to_dict()["counts"] == want.tolist()
