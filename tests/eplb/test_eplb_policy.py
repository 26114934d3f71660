"""Invariants of the placement policy, on seeded random loads (no hypothesis dependency)."""

import pytest
import torch

import pdserve.eplb
from pdserve.eplb import experts_moved, imbalance, policy, rank_load, rebalance_experts, replica_counts

# (layers, experts, physical, ranks, nodes)
SHAPES = [
    (2, 16, 16, 4, 1),  # no redundancy
    (2, 16, 20, 4, 1),
    (3, 16, 24, 8, 2),
    (2, 32, 40, 8, 4),
    (2, 12, 17, 5, 1),  # uneven slots per rank
    (1, 8, 12, 6, 3),
]


def skewed(seed, layers, experts):
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(layers, experts, generator=g) ** 4  # a few hot, many cold
    return base * 1000 + torch.rand(layers, experts, generator=g)


def ranks_of(P, R):
    return [slice(r * P // R, (r + 1) * P // R) for r in range(R)]


def check_valid(phy2log, E, P, R):
    assert phy2log.dtype == torch.long and phy2log.shape[1] == P
    assert phy2log.min() >= 0 and phy2log.max() < E
    cnt = replica_counts(phy2log, E)
    assert (cnt >= 1).all(), "every logical expert needs a replica"
    assert (cnt.sum(1) == P).all(), "slot count must hold"
    for layer in phy2log:
        for s in ranks_of(P, R):
            on_rank = layer[s].tolist()
            # Duplicates on a rank are avoidable unless a rank has more slots than experts.
            if len(on_rank) <= E:
                assert len(set(on_rank)) == len(on_rank), f"two replicas share a rank: {on_rank}"


def test_reexported():
    assert pdserve.eplb.rebalance_experts is policy.rebalance_experts


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(4))
def test_invariants(shape, seed):
    L, E, P, R, N = shape
    load = skewed(seed, L, E)
    out = rebalance_experts(load, P, R, N)
    assert out.shape == (L, P)
    check_valid(out, E, P, R)
    # With a current placement too.
    cur = torch.stack(
        [torch.randperm(P, generator=torch.Generator().manual_seed(seed)) % E for _ in range(L)]
    )
    check_valid(rebalance_experts(load, P, R, N, cur), E, P, R)


@pytest.mark.parametrize("seed", range(4))
def test_balance_within_lpt_bound(seed):
    L, E, P, R = 2, 32, 48, 8
    load = skewed(seed, L, E)
    out = rebalance_experts(load, P, R)
    rl = rank_load(load, out, R)
    cnt = replica_counts(out, E).double()
    for layer in range(L):
        heaviest_replica = (load[layer] / cnt[layer]).max()
        # Longest-first packing never exceeds the mean by more than the heaviest item.
        assert rl[layer].max() <= rl[layer].mean() + heaviest_replica + 1e-9


def test_hot_expert_gets_replicas_on_distinct_ranks():
    load = torch.ones(1, 16)
    load[0, 5] = 100.0
    out = rebalance_experts(load, 24, 8)
    assert replica_counts(out, 16)[0, 5] == 8  # as many as ranks, one per rank
    assert imbalance(rank_load(load, out, 8)) < imbalance(
        rank_load(load, torch.arange(24).remainder(16).unsqueeze(0), 8)
    )


def test_unavoidable_duplicates_still_valid():
    out = rebalance_experts(torch.tensor([[5.0, 1.0]]), 8, 2)
    assert (replica_counts(out, 2) >= 1).all() and out.shape == (1, 8)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(3))
def test_unchanged_load_moves_nothing(shape, seed):
    L, E, P, R, N = shape
    load = skewed(seed, L, E)
    first = rebalance_experts(load, P, R, N)
    again = rebalance_experts(load, P, R, N, first)
    assert experts_moved(first, again, R) == 0
    assert torch.equal(first, again)


@pytest.mark.parametrize("seed", range(4))
def test_small_drift_moves_fewer_than_fresh(seed):
    L, E, P, R = 4, 32, 40, 8
    load = skewed(seed, L, E)
    cur = rebalance_experts(load, P, R)
    g = torch.Generator().manual_seed(100 + seed)
    drifted = load * (0.8 + 0.4 * torch.rand(L, E, generator=g))
    ours = rebalance_experts(drifted, P, R, current=cur)
    fresh = rebalance_experts(drifted, P, R)
    assert experts_moved(cur, ours, R) < experts_moved(cur, fresh, R)
    # ...without giving up balance (slack defaults to 0).
    assert imbalance(rank_load(drifted, ours, R)) <= imbalance(rank_load(drifted, fresh, R)) + 1e-9


def test_slack_trades_balance_for_moves():
    L, E, P, R = 4, 32, 40, 8
    load = skewed(7, L, E)
    cur = rebalance_experts(load, P, R)
    drifted = load * (0.8 + 0.4 * torch.rand(L, E, generator=torch.Generator().manual_seed(8)))
    strict = rebalance_experts(drifted, P, R, current=cur)
    loose = rebalance_experts(drifted, P, R, current=cur, slack=0.05)
    assert experts_moved(cur, loose, R) <= experts_moved(cur, strict, R)
    fresh = rank_load(drifted, rebalance_experts(drifted, P, R), R).max(1).values
    assert (rank_load(drifted, loose, R).max(1).values <= fresh * 1.05 + 1e-6).all()


def test_kept_experts_stay_in_their_slot():
    load = skewed(3, 1, 16)
    cur = rebalance_experts(load, 24, 4)
    new = rebalance_experts(load * torch.linspace(0.7, 1.3, 16), 24, 4, current=cur)
    for s in ranks_of(24, 4):
        a, b = cur[0, s].tolist(), new[0, s].tolist()
        for e in set(a) & set(b):
            assert a.index(e) == b.index(e)  # a kept expert does not even change slot


# ------------------------------------------------------------------ topology


def node_of_slots(P, R, N):
    return [r * N // R for r in range(R) for _ in range(r * P // R, (r + 1) * P // R)]


@pytest.mark.parametrize("seed", range(4))
def test_replicas_stay_within_one_node(seed):
    L, E, P, R, N = 2, 32, 48, 8, 2
    load = 1.0 + torch.rand(L, E, generator=torch.Generator().manual_seed(seed))  # mild skew
    out = rebalance_experts(load, P, R, N)
    nodes = node_of_slots(P, R, N)
    for layer in out.tolist():
        home = {}
        for p, e in enumerate(layer):
            assert home.setdefault(e, nodes[p]) == nodes[p], "replicas of an expert span nodes"
        per_node = [sum(1 for n in home.values() if n == k) for k in range(N)]
        assert per_node == [E // N] * N


def test_groups_stay_on_one_node():
    L, E, P, R, N, G = 1, 32, 48, 8, 4, 8
    load = 1.0 + torch.rand(L, E, generator=torch.Generator().manual_seed(0))
    out = rebalance_experts(load, P, R, N, num_groups=G)
    nodes = node_of_slots(P, R, N)
    group_node = {}
    for p, e in enumerate(out[0].tolist()):
        assert group_node.setdefault(e // (E // G), nodes[p]) == nodes[p]


def test_falls_back_to_flat_when_one_node_cannot_balance():
    load = torch.ones(1, 16)
    load[0, 0] = 1000.0  # needs replicas on every rank, so across nodes
    out = rebalance_experts(load, 32, 8, 2)
    nodes = node_of_slots(32, 8, 2)
    assert {nodes[p] for p, e in enumerate(out[0].tolist()) if e == 0} == {0, 1}
    assert replica_counts(out, 16)[0, 0] == 8


def cross_node_copies(cur, new, nodes):
    """Replicas gained by a node that held no copy of that expert: copies over the network."""
    n = 0
    for a, b in zip(cur.tolist(), new.tolist()):
        before = {(nodes[p], e) for p, e in enumerate(a)}
        n += len({(nodes[p], e) for p, e in enumerate(b)} - before)
    return n


def test_hierarchical_copies_less_across_nodes_than_flat():
    L, E, P, R, N = 2, 32, 48, 8, 2
    nodes = node_of_slots(P, R, N)
    hier = flat = 0
    for seed in range(4):
        load = (1.0 + torch.rand(L, E, generator=torch.Generator().manual_seed(seed))) ** 3
        drift = 0.9 + 0.2 * torch.rand(L, E, generator=torch.Generator().manual_seed(10 + seed))
        cur = rebalance_experts(load, P, R, N)
        hier += cross_node_copies(cur, rebalance_experts(load * drift, P, R, N, cur), nodes)
        flat += cross_node_copies(cur, rebalance_experts(load * drift, P, R, 1, cur), nodes)
    assert hier < flat


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "args",
    [
        (torch.ones(1, 8), 6, 2, 1, None),  # fewer slots than experts
        (torch.ones(1, 8), 8, 3, 2, None),  # ranks not divisible by nodes
        (torch.ones(1, 8), 8, 2, 1, torch.zeros(1, 9, dtype=torch.long)),  # wrong current shape
        (torch.ones(1, 8), 8, 2, 1, torch.full((1, 8), 8)),  # current out of range
        (-torch.ones(1, 8), 8, 2, 1, None),  # negative load
    ],
)
def test_rejects_bad_input(args):
    with pytest.raises(ValueError):
        rebalance_experts(*args)


def test_zero_load_is_fine():
    out = rebalance_experts(torch.zeros(2, 8), 12, 4)
    check_valid(out, 8, 12, 4)
