"""The grouped MoE kernel (kernels/moe.c) against the slot-by-slot path and a float64 reference.

Experts in each packed format (float32 tiles, int8, int4; and plain float stacks, which only the
slot-by-slot path runs), decode-sized and prefill-sized batches, a rank holding a slice of the slots
and slots nobody chose: the kernel gives the loop's values bit for bit (the same qgemm.c tile calls
on the same rows), and both stay within a rounding bound derived from the inputs of the float64
result over the stacks' own (dequantized) weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float_bounds import U32, gamma

from pdserve.eplb.placement import LayerPlacement
from pdserve.model.experts import ExpertStack
from pdserve.model.kernels import moe as moe_kernel
from pdserve.model.kernels import qgemm
from pdserve.model.moe import routed_experts, routed_experts_loop

E, H, INTER, K = 8, 64, 96, 2


def _reference_and_bound(x, slots, weights, gu, dn, lo, hi, mode):
    """float64 sum over the choices in [lo, hi) of weight * down(silu(gate) * up), and a bound on a
    float32 computation's error: each product within gamma(K + 2) of its absolute sums (plus
    bfloat16's 2^-8 where this CPU rounds the activations of quantized products, twice that for
    int4's rounded tile), SiLU's slope at
    most 1.1 plus a few roundings, and the weighted sum's k roundings."""
    wgu, wdn = gu.dense(torch.float64), dn.dense(torch.float64)
    H, INTER, K = gu.shape[1], dn.shape[1], slots.shape[1]  # noqa: N806
    # int4 in the rounded tile (from 32 rows, or where AMX tiles take it: qgemm.amx_rows) rounds its
    # dequantized weight as well.
    bf16 = (2 if mode == "int4" else 1) * 2.0**-8 if mode != "none" and qgemm.bf16_rows(mode) else 0.0
    x64 = x.double()
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if not lo <= s < hi:
                continue
            g = wgu[s] @ x64[t]
            gate, up = g[:INTER], g[INTER:]
            eg = (gamma(H + 2) + bf16) * (wgu[s].abs() @ x64[t].abs())
            egate, eup = eg[:INTER], eg[INTER:]
            act = F.silu(gate) * up
            eact = 1.1 * egate * (up.abs() + eup) + F.silu(gate).abs() * eup + 16 * U32 * act.abs()
            y = wdn[s] @ act
            ey = wdn[s].abs() @ eact + (gamma(INTER + 2) + bf16) * (wdn[s].abs() @ (act.abs() + eact))
            w = float(weights[t, j])
            out[t] += w * y
            bound[t] += abs(w) * ey + gamma(K + 1) * abs(w * y) * 2
    return out, bound + 1e-30


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
@pytest.mark.parametrize("lohi", [(0, E), (2, 6)])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_kernel_matches_loop_and_float64(mode, rows, lohi, threads):
    g = torch.Generator().manual_seed(rows * 10 + lohi[0])
    lo, hi = lohi
    gu_all = ExpertStack.pack(torch.randn(E, 2 * INTER, H, generator=g) / 8, mode, torch.float32, "cpu")
    dn_all = ExpertStack.pack(torch.randn(E, H, INTER, generator=g) / 10, mode, torch.float32, "cpu")
    gu, dn = gu_all[lo:hi], dn_all[lo:hi]  # this rank's slots: views of the whole layer
    pl = LayerPlacement.build(torch.arange(E), E, lo, hi, gu, dn)
    x = torch.randn(rows, H, generator=g)
    # Expert 7 is never chosen: an idle slot inside the rank's range.
    slots = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(rows)])
    weights = torch.rand(rows, K, generator=g)
    ref, bound = _reference_and_bound(x, slots, weights, gu_all, dn_all, lo, hi, mode)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loop = routed_experts_loop(x, slots, weights, pl)
        got = routed_experts(x, slots, weights, pl)
    finally:
        torch.set_num_threads(old)
    for name, out in (("loop", loop), ("kernel", got)):
        err = (out.double() - ref).abs()
        assert bool((err <= bound).all()), (name, float((err / bound).max()))
    if gu.kernel_ready():
        assert torch.equal(got, loop)
    else:  # nothing builds here: routed_experts is the loop
        assert not moe_kernel.available() or mode == "none"


def test_plain_stacks_and_strided_rows_take_the_loop():
    """Float stacks the tiles cannot hold (odd shapes) and rows with a stride: the same values."""
    g = torch.Generator().manual_seed(5)
    w_gu, w_dn = torch.randn(4, 2 * 24, 40, generator=g) / 6, torch.randn(4, 40, 24, generator=g) / 5
    gu = ExpertStack.pack(w_gu, "int8", torch.float32, "cpu")
    dn = ExpertStack.pack(w_dn, "int8", torch.float32, "cpu")
    assert gu.kind == dn.kind == "plain" and not gu.kernel_ready()
    pl = LayerPlacement.build(torch.arange(4), 4, 0, 4, gu, dn)
    x = torch.randn(5, 80, generator=g)[:, ::2]  # rows 80 floats apart
    slots, weights = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2]]), torch.rand(5, 2, generator=g)
    got = routed_experts(x, slots, weights, pl)
    ref, bound = _reference_and_bound(x, slots, weights, gu, dn, 0, 4, "none")
    assert bool(((got.double() - ref).abs() <= bound).all())


def test_kernel_reads_each_stacked_format_as_dequantized():
    """A stack's tensors are the dense formats slot after slot: each slot dequantizes to the
    quantization of its own expert."""
    from pdserve.model.quant import quantize

    g = torch.Generator().manual_seed(6)
    w = torch.randn(3, 32, 64, generator=g)
    for mode in ("int8", "int4"):
        st = ExpertStack.pack(w, mode, torch.float32, "cpu")
        assert st.kind == mode
        for e in range(3):
            assert torch.equal(st.dense()[e], quantize(w[e], mode).dequantize())
    assert torch.equal(ExpertStack.pack(w, "none", torch.float32, "cpu").dense(), w)


def _decode_step(model, lens, seed=1, prefill=0):
    """A step of decodes with contexts `lens` over a random paged cache (and a prompt of `prefill` tokens)."""
    from pdserve.model.attention import build_metadata

    g = torch.Generator().manual_seed(seed)
    a, block = model.arch, 16
    blocks = 8 + sum(-(-n // block) for n in lens) + -(-prefill // block)
    kv = torch.randn(a.kv_cache_shape(blocks * block), generator=g)
    perm = torch.randperm(blocks, generator=g).tolist()
    seqs, positions, p = [], [], 0
    for n in sorted(lens):
        nb = -(-n // block)
        seqs.append((perm[p : p + nb], n - 1, 1))
        positions.append(n - 1)
        p += nb
    if prefill:
        seqs.append((perm[p : p + -(-prefill // block)], 0, prefill))
        positions += range(prefill)
    meta = build_metadata(seqs, block, a.sliding_window, "cpu")
    ids = torch.randint(0, a.vocab_size, (len(positions),), generator=g)
    return ids, torch.tensor(positions), meta, kv


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek-moe"])
@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize(
    "lens,prefill",
    [([5], 0), ([3, 9, 17, 40, 41, 100, 30, 33, 64, 12], 0), ([7, 30], 24)],
    ids=["one", "ten", "with-a-prompt"],
)
def test_moe_decode_step_through_layer_c_is_the_op_by_op_step(name, quant, lens, prefill):
    """A step of a MoE model (decodes, and a prompt's chunk): each layer's attention half in layer.c
    (dense layers whole), the MoE blocks between the calls; the same logits and cache as op by op, bit
    for bit."""
    from pdserve.config import ModelConfig
    from pdserve.model.kernels import layer as fused_kernels
    from pdserve.model.loader import build_model, load_model_files

    if not fused_kernels.available():
        pytest.skip("no C compiler here: layers run op by op")
    model = build_model(load_model_files(name), model_config=ModelConfig(quantization=quant)).model
    assert model.fused is not None
    ids, positions, meta, kv = _decode_step(model, lens, prefill=prefill)
    assert fused_kernels.FusedStep.applies(meta, len(ids), model.fused_prefill_rows())
    last = torch.arange(len(ids))
    got_kv, done = kv.clone(), []
    got = model.forward(ids, positions, meta, got_kv, last, layer_done=done.append)
    fused, model.fused = model.fused, None
    try:
        want_kv = kv.clone()
        want = model.forward(ids, positions, meta, want_kv, last)
    finally:
        model.fused = fused
    assert done == list(range(model.arch.num_layers))
    assert torch.equal(got, want) and torch.equal(got_kv, want_kv)
    assert not torch.equal(got_kv, kv)  # the step wrote its keys and values


def test_moe_models_layer_c_does_not_take_run_op_by_op():
    """q/k norms (Qwen3-MoE) and latent attention are not in layer.c."""
    from pdserve.model.loader import build_model, load_model_files

    for name in ("tiny-qwen3-moe", "tiny-deepseek-v3"):
        assert build_model(load_model_files(name)).model.fused is None


def test_fused_moe_step_holds_when_the_loaded_weights_move():
    """An expert-parallel model moves the loaded weights into shared memory, and another engine built
    on the same weights (tests do this) may hold some of them as they are: its fused step must not keep
    their old addresses."""
    from pdserve.config import ModelConfig
    from pdserve.model.kernels import layer as fused_kernels
    from pdserve.model.loader import build_model, load_model_files

    if not fused_kernels.available():
        pytest.skip("no C compiler here: layers run op by op")
    loaded = load_model_files("tiny-qwen2-moe")
    model = build_model(loaded, model_config=ModelConfig(quantization="int8")).model
    ids, positions, meta, kv = _decode_step(model, [7, 20, 33])
    last = torch.arange(len(ids))
    want = model.forward(ids, positions, meta, kv.clone(), last)
    for v in loaded.weights.values():
        v.share_memory_()  # a new storage for each: the old one is freed
        torch.zeros(v.shape).fill_(float("nan"))  # and likely reused
    assert torch.equal(model.forward(ids, positions, meta, kv.clone(), last), want)
