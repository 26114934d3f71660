"""Ranks of other hosts: their KV pools (model/ep_kv.py: which blocks a step reads and writes, rank
0's record of what each rank holds, the plan on the wire, the bytes moved) and the experts they are
sent for new placements (model/ep_fetch.py), over a real gloo group (ranks as threads)."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_ranks

from pdserve.eplb.placement import slot_range
from pdserve.model.attention import build_metadata
from pdserve.model.dp_attention import split_step, step_units
from pdserve.model.ep_fetch import fetch_experts, missing
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


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_ranks_of_other_hosts_get_the_experts_a_placement_gives_them_byte_for_byte(mode):
    """Rank 0 (every expert) sends ranks 1 and 2 (other hosts: their own slots only) the experts the new
    placement puts in their slots and the old one did not; each arrives as the same packed tensors."""
    g = torch.Generator().manual_seed(0)
    experts, layers, world = 8, 2, 3
    store = [
        (
            ExpertStack.pack(torch.randn(experts, 64, 64, generator=g), mode, torch.float32, "cpu"),
            ExpertStack.pack(torch.randn(experts, 64, 32, generator=g), mode, torch.float32, "cpu"),
        )
        for _ in range(layers)
    ]
    old = torch.arange(experts).repeat(layers, 1)
    new = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)])

    def body(rank, comm):
        lo, hi = slot_range(experts, rank, world)
        own = [(gu[old[j, lo:hi]], dn[old[j, lo:hi]]) for j, (gu, dn) in enumerate(store)]
        return fetch_experts(comm, old, new, 1, store if rank == 0 else None, own)

    out = run_ranks(world, body)
    assert out[0].experts == {} and out[0].sent_bytes > 0
    sent = 0
    for r in range(1, world):
        assert sorted(out[r].experts) == missing(old, new, r, world)
        for (j, e), (gu, dn) in out[r].experts.items():
            for got, want in zip((gu, dn), store[j]):
                assert got.kind == want.kind and len(got) == 1
                for a, b in zip(got.tensors, want.tensors):
                    assert torch.equal(a[0], b[e])
                    sent += a.numel() * a.element_size()
    assert out[0].sent_bytes == sent
