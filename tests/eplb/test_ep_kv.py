"""Ranks of other hosts: their KV pools (model/ep_kv.py: which blocks a step reads and writes, rank
0's record of what each rank holds, the plan on the wire, the bytes moved) and the experts ranks
fetch for new placements from the ranks holding them (model/ep_fetch.py), over a real gloo group
(ranks as threads)."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_ranks

from pdserve.eplb.placement import slot_range
from pdserve.model.attention import build_metadata
from pdserve.model.dp_attention import split_step, step_units
from pdserve.model.ep_fetch import fetch_experts, missing, plan_fetch
from pdserve.model.ep_kv import (
    Residency,
    StepPlan,
    decode_plan,
    encode_plan,
    mirror,
    ship,
    unit_kv,
)
from pdserve.model.experts import ExpertStack

BS = 4


def _meta(seqs):
    return build_metadata(seqs, BS, None, "cpu")


def test_units_read_their_context_blocks_and_write_their_new_tokens_blocks():
    seqs = [
        ([7, 3, 9], 9, 1),  # decode at position 9: reads positions 0..8 (blocks 7, 3, 9), writes block 9
        ([5, 6], 4, 1),  # decode at position 4: reads block 5 only, writes block 6 (a new block)
        ([1, 2, 8], 0, 10),  # a first chunk: reads nothing, writes blocks 1, 2, 8
        ([11, 12, 13], 6, 5),  # a chunk after 6 cached positions: reads 11, 12; writes 12, 13
    ]
    meta = _meta(seqs)
    units = step_units(meta)
    got = {(u[0], u[1]): k for u, k in zip(units, unit_kv(meta, units))}
    # Decode rows are ordered by context within their groups; find each by the block it writes.
    decodes = sorted((k for (kind, _), k in got.items() if kind == 0), key=lambda k: k.written)
    assert [(d.read, d.written) for d in decodes] == [([5], [6]), ([7, 3, 9], [9])]
    chunks = [k for (kind, _), k in sorted(got.items()) if kind == 1]
    assert [(c.read, c.written) for c in chunks] == [([], [1, 2, 8]), ([11, 12], [12, 13])]


def _decodes(ctx: list[int], tables: list[list[int]]):
    return _meta([(t, c, 1) for t, c in zip(tables, ctx)])


def _rank_by_written_block(plan: StepPlan) -> dict[int, int]:
    return {k.written[0]: r for k, r in zip(plan.kv, plan.ranks)}


def test_a_sequence_stays_where_its_blocks_are_and_only_missing_blocks_travel():
    res = Residency(2, 32)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    meta = _decodes([8, 8, 8, 8], tables)
    units = step_units(meta)
    first = res.plan(meta, units, 64)  # a token's work well above a block's keys
    assert sorted(first.ranks) == [0, 0, 1, 1]  # equal costs: the load splits evenly
    on1 = [k for k, r in zip(first.kv, first.ranks) if r == 1]
    assert first.ship[0] == [] and first.ship[1] == sorted(b for k in on1 for b in k.read)
    res.update(first)
    # The next decode step (one position on): every sequence stays, nothing travels.
    meta = _decodes([9, 9, 9, 9], tables)
    again = res.plan(meta, step_units(meta), 64)
    assert _rank_by_written_block(again) == _rank_by_written_block(first)
    assert again.ship == [[], []]
    res.update(again)
    # A block handed out anew holds something else now: rank 1 lacks it again.
    held = on1[0].read[0]
    assert res.valid[1, held]
    res.allocated([held])
    assert not res.valid[1, held] and res.valid[0, held]


def test_a_write_on_one_rank_makes_the_block_stale_on_the_others():
    res = Residency(3, 16)
    meta = _decodes([5], [[0, 1]])
    plan = StepPlan([2], [[], [], [0]], unit_kv(meta, step_units(meta)))
    res.update(plan)
    assert res.valid[:, 0].tolist() == [True, False, True] and res.valid[:, 1].tolist() == [True, False, True]
    res.valid[1, [0, 1]] = True  # say rank 1 held them too
    meta = _decodes([6], [[0, 1]])
    res.update(StepPlan([0], [[], [], []], unit_kv(meta, step_units(meta))))  # rank 0 writes position 5
    assert res.valid[:, 1].tolist() == [True, False, False]  # the written block: stale elsewhere
    assert res.valid[:, 0].tolist() == [True, True, True]  # a block only read stays valid


def test_the_plan_travels_as_integers():
    plan = StepPlan([0, 2, 1, 2], [[], [5, 9], [], [1, 2, 3]])
    assert decode_plan(encode_plan(plan), 4, 4) == StepPlan(plan.ranks, plan.ship)


def _pool(rank: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(3, 2, 8 * BS, 2, 4, generator=g) * (rank + 1)).to(dtype)


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.bfloat16)])
def test_ship_and_mirror_move_exact_bytes(world, dtype):
    to_send = [[], [1, 6], [0, 3, 7]][:world]
    meta = _meta([([0, 1], 5, 1), ([2, 3], 2, 3), ([4, 5], 6, 1)])
    units = step_units(meta)
    ranks = [u % world for u in range(len(units))]
    shares = split_step(meta, meta.slot_mapping.numel(), None, world, 1, ranks)

    def body(rank, comm):
        kv = _pool(rank, dtype)
        before = kv.clone()
        sent = ship(comm, kv, BS, to_send)
        after_ship = kv.clone()
        mirror(comm, kv, shares)
        return before, after_ship, kv, sent

    out = run_ranks(world, body)
    base = _pool(0, dtype).view(3, 2, 8, BS, 2, 4)
    assert out[0][3] == sum(len(b) for b in to_send) * base[:, :, 0].numel() * base.element_size()
    for r in range(1, world):
        before, after, _, _ = out[r]
        got = after.view(3, 2, 8, BS, 2, 4)
        for b in range(8):
            want = base[:, :, b] if b in to_send[r] else before.view(3, 2, 8, BS, 2, 4)[:, :, b]
            assert torch.equal(got[:, :, b], want), (r, b)
    # Rank 0's pool after the mirror: every other rank's written slots hold that rank's rows.
    final0 = out[0][2]
    written = {int(s): r for r in range(world) for s in shares[r].meta.slot_mapping}
    for slot in range(8 * BS):
        src = out[written[slot]][1] if slot in written and written[slot] else out[0][1]
        assert torch.equal(final0[:, :, slot], src[:, :, slot]), slot


def _holders(old: torch.Tensor, j: int, e: int, world: int) -> list[int]:
    ranges = [slot_range(old.shape[1], r, world) for r in range(world)]
    return [r for r, (lo, hi) in enumerate(ranges) if e in old[j, lo:hi].tolist()]


def test_each_missing_expert_comes_from_a_holder_on_the_same_host_where_there_is_one():
    """The plan every rank computes alike: an expert a rank lacks comes from a rank holding it under
    the placement in force, on the rank's own host where one does, else the holder with the fewest
    experts to send so far (so no one rank sends them all)."""
    g = torch.Generator().manual_seed(3)
    experts, layers, world = 16, 3, 4  # 24 slots: 6 a rank, 8 of them replicas
    old = torch.stack(
        [
            torch.cat([torch.randperm(experts, generator=g), torch.randperm(experts, generator=g)[:8]])
            for _ in range(layers)
        ]
    )
    new = torch.stack(
        [
            torch.cat([torch.randperm(experts, generator=g), torch.randperm(experts, generator=g)[:8]])
            for _ in range(layers)
        ]
    )
    for per_host in (1, 2, 4):
        plan = plan_fetch(old, new, world, per_host)
        sends = [0] * world
        for d in range(world):
            assert [(j, e) for j, e, _ in plan[d]] == missing(old, new, d, world)
            for j, e, src in plan[d]:
                holders = _holders(old, j, e, world)
                assert src in holders and src != d
                near = [r for r in holders if r // per_host == d // per_host]
                assert src in (near or holders)
                sends[src] += 1
        assert sum(sends) == sum(len(missing(old, new, d, world)) for d in range(world))
        assert sum(1 for n in sends if n) > 1, sends  # spread over the holders
    # An expert no rank holds cannot be fetched: a clear error, not a wrong slot.
    with pytest.raises(ValueError, match="no rank holds expert"):
        plan_fetch(torch.zeros(1, 4, dtype=torch.long), torch.arange(4).view(1, 4), 2, 1)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
@pytest.mark.parametrize("per_host", [1, 2])
def test_ranks_get_the_experts_a_placement_gives_them_byte_for_byte_from_the_ranks_holding_them(
    mode, per_host
):
    """No rank holds every expert: each sends from its own slots the experts the new placement gives
    other ranks, and each gets what it lacks as the same packed tensors."""
    g = torch.Generator().manual_seed(0)
    experts, layers, world = 8, 2, 3
    store = [
        (
            ExpertStack.pack(torch.randn(experts, 64, 64, generator=g), mode, torch.float32, "cpu"),
            ExpertStack.pack(torch.randn(experts, 64, 32, generator=g), mode, torch.float32, "cpu"),
        )
        for _ in range(layers)
    ]
    slots = experts + 4
    old = torch.stack(
        [torch.cat([torch.randperm(experts, generator=g), torch.arange(4)]) for _ in range(layers)]
    )
    new = torch.stack(
        [torch.cat([torch.randperm(experts, generator=g), torch.arange(4, 8)]) for _ in range(layers)]
    )

    def body(rank, comm):
        lo, hi = slot_range(slots, rank, world)
        own = [(gu[old[j, lo:hi]], dn[old[j, lo:hi]]) for j, (gu, dn) in enumerate(store)]
        return fetch_experts(comm, old, new, per_host, own)

    out = run_ranks(world, body)
    received = 0
    for r in range(world):
        assert sorted(out[r].experts) == missing(old, new, r, world)
        for (j, e), (gu, dn) in out[r].experts.items():
            for got, want in zip((gu, dn), store[j]):
                assert got.kind == want.kind and len(got) == 1
                for a, b in zip(got.tensors, want.tensors):
                    assert torch.equal(a[0], b[e])
                    received += a.numel() * a.element_size()
    assert sum(o.sent_bytes for o in out) == received > 0
    assert sum(1 for o in out if o.sent_bytes) > 1  # not one sender for every move
