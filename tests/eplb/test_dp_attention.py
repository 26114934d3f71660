"""Data-parallel attention for expert parallelism: the split of a step over the ranks, and the row
exchange of a MoE layer over a real gloo group or shared-memory mailboxes (ranks as threads of this
process), in one batch or as two micro-batches overlapping their exchanges."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from gloo_ranks import in_threads, run_ranks

from pdserve.eplb.placement import LayerPlacement, slot_range
from pdserve.model import ep_shm
from pdserve.model.attention import build_metadata
from pdserve.model.dp_attention import assign, split_step
from pdserve.model.ep_exchange import ExpertExchange, plan_dispatch, slot_owners
from pdserve.model.ep_overlap import Baton
from pdserve.model.ep_protocol import Comm

BS = 4


def _meta(seqs):
    return build_metadata(seqs, BS, None, "cpu")


def _step():
    """Five decodes of different contexts and two prefill chunks (one after cached context)."""
    seqs = [([i * 8 + j for j in range(8)], ctx, 1) for i, ctx in enumerate([3, 30, 7, 12, 25])]
    seqs += [([40 + j for j in range(6)], 0, 9), ([50 + j for j in range(8)], 10, 6)]
    n = sum(s[2] for s in seqs)
    return seqs, _meta(seqs), n


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_row_goes_to_exactly_one_rank_with_its_own_metadata(world):
    seqs, meta, n = _step()
    logits = torch.tensor([0, 2, 4, 13, 19])  # some decodes, the chunks' last rows
    shares = split_step(meta, n, logits, world, per_token=10)
    rows = torch.cat([s.tokens for s in shares])
    assert sorted(rows.tolist()) == list(range(n))
    order = torch.cat([s.logits_order for s in shares])
    assert sorted(order.tolist()) == list(range(5))
    for s in shares:
        # The share's metadata is the step's, restricted: the same slots and the same attended keys.
        torch.testing.assert_close(s.meta.slot_mapping, meta.slot_mapping[s.tokens])
        mine = {int(t) for t in s.tokens}
        for r, o in zip(s.logits_rows.tolist(), s.logits_order.tolist()):
            assert int(s.tokens[r]) == int(logits[o])
        # Rebuilding the metadata from this rank's sequences alone gives the same attention inputs.
        own, start = [], 0
        for seq in seqs:
            if start in mine:
                own.append(seq)
            start += seq[2]
        want = _meta(sorted(own, key=lambda q: (q[2] != 1,)))
        got_rows = [g.block_idx.shape[0] for g in s.meta.decode_groups]
        assert sum(got_rows) == sum(g.block_idx.shape[0] for g in want.decode_groups)
        assert [(p.q_len, p.ctx_len) for p in s.meta.prefills] == [
            (p.q_len, p.ctx_len) for p in want.prefills
        ]
        start = 0
        for g in s.meta.decode_groups:
            assert g.start == start
            first, ctx = g.attended()
            m = g.mask.reshape(g.mask.shape[0], -1).to(torch.int8)
            assert torch.equal(ctx, (m.shape[1] - m.flip(1).argmax(1)).long())
            start += g.block_idx.shape[0]
        for p in s.meta.prefills:
            assert p.q_start == start
            start += p.q_len


def test_lpt_balances_decode_rows_by_attended_keys():
    # 32 decodes at context 2,048 over 2 ranks: 16 each; mixed contexts: within one row of the mean.
    units = [(0, i, 1, 2048) for i in range(32)]
    ranks = assign(units, 2, per_token=100)
    assert ranks.count(0) == ranks.count(1) == 16
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 4000, (64,), generator=g).tolist()
    units = [(0, i, 1, c) for i, c in enumerate(ctx)]
    for world in (2, 4):
        ranks = assign(units, world, per_token=0)
        load = [sum(c for c, r in zip(ctx, ranks) if r == k) for k in range(world)]
        assert max(load) - min(load) <= max(ctx)
        assert max(load) / (sum(load) / world) <= 1.1
    assert assign([], 3, 5) == []


def test_plan_sends_a_token_once_to_each_remote_rank_of_its_choices():
    owners = slot_owners(8, 2)  # slots 0-3 on rank 0, 4-7 on rank 1
    assert owners.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    slots = torch.tensor([[0, 1], [4, 5], [1, 6], [7, 2]])
    plan = plan_dispatch(slots, owners, 0, 2)
    assert plan.rows[0].numel() == 0
    assert plan.rows[1].tolist() == [1, 2, 3]
    assert plan.slots[1].tolist() == [[4, 5], [-1, 6], [7, -1]]
    empty = plan_dispatch(torch.zeros(0, 2, dtype=torch.long), owners, 1, 2)
    assert [r.numel() for r in empty.rows] == [0, 0]


def _expert(x, slot):
    """A stand-in expert with a different linear map per slot (deterministic, exact in float64)."""
    return x * (slot + 1) + slot


def _all_choices(h, slots, w):
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(slots.shape[1]):
            out[t] += w[t, j] * _expert(h[t], int(slots[t, j]))
    return out


def _rank_experts(P, rank, world):
    """Rank `rank`'s placement of P identity slots, and its compute: the stand-in experts of the
    choices in its slots, the others skipped (as routed_experts skips other ranks' slots)."""
    lo, hi = slot_range(P, rank, world)
    pl = LayerPlacement.build(torch.arange(P), P, lo, hi, None, None)

    def compute(x, s, w):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(s.shape[1]):
                if lo <= int(s[t, j]) < hi:
                    out[t] += w[t, j].to(x.dtype) * _expert(x[t], int(s[t, j]))
        return out

    return pl, compute


@pytest.mark.parametrize("world,dtype", [(2, torch.float64), (3, torch.float64), (2, torch.float32)])
def test_exchange_gives_every_choice_and_sends_only_remote_rows(world, dtype):
    """float32 rows travel with their choices in one message, other dtypes apart: both checked."""
    P, H, k = 8, 16, 2
    g = torch.Generator().manual_seed(world)
    # Each rank's own tokens (rank 2 of 3 has none: it still takes part).
    toks = [
        torch.randn(5, H, generator=g, dtype=dtype),
        torch.randn(3, H, generator=g, dtype=dtype),
    ]
    toks += [torch.zeros(0, H, dtype=dtype)] * (world - 2)
    slots = [
        torch.stack([torch.randperm(P, generator=g)[:k] for _ in range(t.shape[0])])
        if t.shape[0]
        else torch.zeros(0, k, dtype=torch.long)
        for t in toks
    ]
    weights = [torch.rand(t.shape[0], k, generator=g) for t in toks]

    def fn(rank, comm):
        pl, compute = _rank_experts(P, rank, world)

        ex = ExpertExchange(comm, rank, world)
        out = ex(toks[rank], slots[rank], weights[rank], pl, compute)
        return out, ex.dispatch_bytes, ex.combine_bytes

    res = run_ranks(world, fn)
    owners = slot_owners(P, world)
    for rank in range(world):
        out, sent, back = res[rank]
        want = _all_choices(toks[rank].double(), slots[rank], weights[rank].double())
        # float32: the sum of a token's choices in another order than the reference's, float64.
        tol = 0 if dtype == torch.float64 else 8 * 2**-24 * float(want.abs().max())
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=0 if tol == 0 else 1e-6)
        # Bytes: a row per token per remote rank among its choices' owners.
        remote = sum(len({int(owners[s]) for s in row} - {rank}) for row in slots[rank])
        assert sent == remote * H * toks[rank].element_size()
    # What a rank sends back is what the others sent it.
    assert sum(r[2] for r in res) == sum(r[1] for r in res)


def test_bfloat16_dispatch_rounds_only_the_rows_sent_and_halves_their_bytes():
    """model.ep_dispatch_dtype bfloat16 on a float32 model: a choice computed on another rank sees
    its token's row rounded to bfloat16, one computed here the row itself; the results come back in
    float32; the rows sent cost 2 bytes a value."""
    world, P, H, k = 2, 8, 16, 2
    g = torch.Generator().manual_seed(7)
    toks = [torch.randn(6, H, generator=g), torch.randn(4, H, generator=g)]
    slots = [torch.stack([torch.randperm(P, generator=g)[:k] for _ in range(t.shape[0])]) for t in toks]
    weights = [torch.rand(t.shape[0], k, generator=g) for t in toks]
    owners = slot_owners(P, world)

    def fn(rank, comm):
        pl, compute = _rank_experts(P, rank, world)

        ex = ExpertExchange(comm, rank, world, dispatch_dtype=torch.bfloat16)
        return ex(toks[rank], slots[rank], weights[rank], pl, compute), ex.dispatch_bytes

    res = run_ranks(world, fn)
    for rank in range(world):
        out, sent = res[rank]
        assert out.dtype == torch.float32
        h, want = toks[rank].double(), torch.zeros(toks[rank].shape, dtype=torch.float64)
        for t in range(h.shape[0]):
            for j in range(k):
                s = int(slots[rank][t, j])
                x = h[t] if int(owners[s]) == rank else h[t].bfloat16().double()
                want[t] += float(weights[rank][t, j]) * _expert(x, s)
        # float32 products and sums of a few terms: a few units of float32 rounding of the largest.
        tol = 8 * 2**-24 * float(want.abs().max())
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=1e-6)
        remote = sum(len({int(owners[s]) for s in row} - {rank}) for row in slots[rank])
        assert remote > 0 and sent == remote * H * 2


def _shm_ranks(world, capacity, fn):
    """fn(rank, comm) with each rank's all-to-all through one file of mailboxes (ep_shm)."""
    path = ep_shm.create(world, capacity)
    try:
        views = [ep_shm.ShmAllToAll(path, r, world, capacity) for r in range(world)]

        def rank(r):
            comm = Comm(None, r, world, torch.device("cpu"), 60)
            comm.shm = views[r]
            return fn(r, comm)

        return in_threads(world, rank)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("world,transport", [(2, "gloo"), (3, "gloo"), (2, "shm"), (3, "shm")])
def test_two_micro_batches_overlap_their_exchanges_and_give_every_choice(world, transport):
    """Each rank's tokens as two micro-batches through 4 MoE layers: every all-to-all is started, the
    baton passed to the other micro-batch and the answer read once it is back (gloo: collectives in
    flight; shm: a lane of mailboxes each, small enough that long messages go in rounds). Every token
    gets every choice, exactly as one batch would (float64); the last rank of 3 has no tokens at all
    and rank 1's second micro-batch none, yet each takes part in every exchange."""
    P, H, k, L = 6, 8, 2, 4
    g = torch.Generator().manual_seed(10 + world)
    counts = [(4, 3), (2, 0)] + [(0, 0)] * (world - 2)
    toks = [[torch.randn(n, H, generator=g, dtype=torch.float64) for n in c] for c in counts]
    slots = [
        [
            [
                torch.stack([torch.randperm(P, generator=g)[:k] for _ in range(n)])
                if n
                else torch.zeros(0, k, dtype=torch.long)
                for n in c
            ]
            for _ in range(L)
        ]
        for c in counts
    ]
    weights = [[[torch.rand(n, k, generator=g) for n in c] for _ in range(L)] for c in counts]

    def fn(rank, comm):
        pl, compute = _rank_experts(P, rank, world)

        ex = ExpertExchange(comm, rank, world, overlap=True)
        lanes = []

        def lane(m):
            def run():
                lanes.append((m, threading.current_thread().name))
                h = toks[rank][m]
                for layer in range(L):
                    h = ex(h, slots[rank][layer][m], weights[rank][layer][m], pl, compute) / 8
                return h

            return run

        return ex.baton.run(lane(0), lane(1)), lanes

    res = (run_ranks if transport == "gloo" else lambda w, f: _shm_ranks(w, 64, f))(world, fn)
    for rank in range(world):
        outs, lanes = res[rank]
        assert len({name for _, name in lanes}) == 2  # two threads, one micro-batch each
        for m in range(2):
            want = toks[rank][m]
            for layer in range(L):
                want = _all_choices(want, slots[rank][layer][m], weights[rank][layer][m].double()) / 8
            torch.testing.assert_close(outs[m], want, atol=0, rtol=0)


def test_a_failed_micro_batch_stops_the_other_at_its_next_exchange():
    """The baton: a lane that raises ends its turn; the other stops at its next hand-over (it never
    waits for a partner that is gone), and `run` raises the cause, not the other lane's stop."""
    baton = Baton()
    steps = []

    def first():
        steps.append("a0")
        baton.pass_()
        steps.append("a1")
        baton.pass_()
        steps.append("a2")  # never: the other lane failed meanwhile

    def second():
        steps.append("b0")
        raise ValueError("peer lost")

    with pytest.raises(ValueError, match="peer lost"):
        baton.run(first, second)
    assert steps == ["a0", "b0"]
    # The baton serves the next step afresh.
    assert baton.run(lambda: 1, lambda: 2) == (1, 2)


@pytest.mark.slow
def test_wide_ep_benchmark_prints_its_ratios():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = ["--sequences", "4", "--context", "64", "--layers", "2", "--experts", "4", "--hidden", "64"]
    args += ["--prefill-sequences", "2", "--prefill-chunk", "16"]
    r = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "wide_ep.py"), *args, "--steps", "1", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "wide_ep" and set(out["tok_s"]) == {"ep1", "replicated", "data", "overlap"}
    assert out["overlap_over_data"] > 0 and out["prefill_overlap_over_data"] > 0
    assert out["attended_max_over_mean"] == 1.0  # 4 equal sequences over 2 ranks
    # A token goes to the other rank at most once a layer: never more than the all-reduce's rows.
    assert 0 < out["rank0_sent_bytes_per_layer_step"] <= out["allreduce_payload_bytes_per_layer"]
