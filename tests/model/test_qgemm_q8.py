"""int4 products with int8 activations (kernels/qgemm_q8.c, model.activation_quantization: int8):
the activations' quantization, the product against a float64 reference from the dequantized weight and
the *quantized* activations (exact up to the float steps' roundings), the error against unquantized
activations within what int8 rounding allows, a row's output bit for bit the same alone and in any
batch or thread split, and the portable C build bit for bit the same as this CPU's."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch
from float_bounds import U32, assert_within
from kernel_builds import runnable_qgemm

from pdserve.model.kernels import qgemm
from pdserve.model.quant import QuantizedWeight, quantize

needs_kernel = pytest.mark.skipif(not qgemm.available(), reason="no C compiler here")
N, K = 64, 608  # 19 groups of 32: past the kernel's run of 16 buffered groups


def _weight(n=N, k=K, seed=0) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedWeight(quantize(w, "int4"), "cpu", native=True, activations="int8")


def _rows(m, k=K, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of differing scale, some blocks with an outlier, one block all zeros.
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]
    x[:, 37] *= 40
    x[0, 64:96] = 0
    return x


def _product(w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    bits, t, d, m = w.operands()
    assert bits == 4 | qgemm.AQ8
    return qgemm.qgemm(bits, t, d, m, x, w.shape[0])


def _reference(w: QuantizedWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product of the dequantized weight with the kernel's quantized activations, and the bound
    on the kernel's float roundings: per group d * sx rounded, two FMAs into the accumulator (G groups:
    2 G + 2 roundings of the running sum at most), and sx * sum q rounded once (the offset's term)."""
    q, sx, ss = qgemm.quantize_rows(x)
    m, k = x.shape
    g = k // 32
    xhat = (q.double().view(m, g, 32) * sx.double()[..., None]).view(m, k)
    nib, d, mm = w.tiled
    wd = qgemm.untile_int4(nib, d, mm).double()  # exact: q * d + m of float16 values in float32
    ref = xhat @ wd.t()
    # The per-group terms' magnitudes: |d sx I| and |m ss| summed over the groups, row by channel.
    dq = d.double().permute(0, 2, 1).reshape(-1, g)  # [N, G]
    mq = mm.double().permute(0, 2, 1).reshape(-1, g)
    wq = torch.round((wd.view(-1, g, 32) - mq[..., None]) / dq[..., None])  # the stored nibbles
    ints = torch.einsum("mgk,ngk->mng", q.double().view(m, g, 32), wq)  # I per row, channel, group
    mag = (ints.abs() * dq[None] * sx.double()[:, None, :]).sum(-1) + (
        mq.abs()[None] * (sx.double() * q.double().view(m, g, 32).sum(-1)).abs()[:, None, :]
    ).sum(-1)
    return ref, (2 * g + 4) * U32 * mag * (1 + 1e-6)


@needs_kernel
def test_activations_quantize_per_block_within_half_a_step():
    x = _rows(5)
    q, sx, ss = qgemm.quantize_rows(x)
    blocks = x.view(5, -1, 32)
    amax = blocks.abs().amax(-1)
    assert torch.equal(sx, amax / 127)
    assert int(q.abs().max()) <= 127 and int(q.abs().max()) == 127  # the block's largest value at the edge
    err = (q.view(5, -1, 32).float() * sx[..., None] - blocks).abs()
    assert bool((err <= sx[..., None] * (0.5 + 1e-5)).all())
    assert torch.equal(ss, sx * q.view(5, -1, 32).sum(-1).float())
    assert bool((q[0, 64:96] == 0).all()) and float(sx[0, 2]) == 0.0
    # A row's quantization is its own: the same row alone.
    q1, sx1, ss1 = qgemm.quantize_rows(x[3:4])
    assert torch.equal(q1, q[3:4]) and torch.equal(sx1, sx[3:4]) and torch.equal(ss1, ss[3:4])


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
def test_product_is_the_dequantized_weight_times_the_quantized_activations(m):
    w, x = _weight(), _rows(m)
    ref, bound = _reference(w, x)
    assert_within(_product(w, x), ref, bound, f"{m} rows")


def _weight8(n=N, k=K, seed=0) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedWeight(quantize(w, "int8"), "cpu", native=True, activations="int8")


def _reference8(w: QuantizedWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights: per group acc = fma(sx, I, acc), then times the channel's scale (G + 2 roundings)."""
    q, sx, _ = qgemm.quantize_rows(x)
    m, k = x.shape
    g = k // 32
    xhat = (q.double().view(m, g, 32) * sx.double()[..., None]).view(m, k)
    wq = w.tiled[0].transpose(1, 2).reshape(w.shape).double()  # [N, K] integers
    scale = w.scale.double()
    ref = (xhat @ wq.t()) * scale
    ints = torch.einsum("mgk,ngk->mng", q.double().view(m, g, 32), wq.view(-1, g, 32)).abs()
    mag = (ints * sx.double()[:, None, :]).sum(-1) * scale.abs()
    return ref, (g + 3) * U32 * mag * (1 + 1e-6)


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 33])
def test_int8_weight_product_is_the_weight_times_the_quantized_activations(m):
    w, x = _weight8(), _rows(m)
    ref, bound = _reference8(w, x)
    bits, t, d, mm = w.operands()
    assert bits == 8 | qgemm.AQ8
    assert_within(qgemm.qgemm(bits, t, d, mm, x, N), ref, bound, f"{m} rows")


@needs_kernel
def test_int8_weight_rows_are_the_same_alone_and_in_any_batch():
    w, x = _weight8(), _rows(17, seed=4)
    alone = torch.cat([w.matmul(x[i : i + 1]) for i in range(17)])
    for size in (2, 4, 5, 8, 9, 17):
        assert torch.equal(w.matmul(x[:size]), alone[:size]), size


@needs_kernel
def test_error_against_float_activations_is_within_the_int8_rounding():
    """|y - x @ w.T| <= sum over groups of (sx / 2) * sum |w| (each value moved by half a step at most),
    plus the float roundings."""
    w, x = _weight(), _rows(8)
    ref, bound = _reference(w, x)
    _, sx, _ = qgemm.quantize_rows(x)
    wd = w.dequantize().double()
    per_group = wd.abs().view(N, -1, 32).sum(-1)  # [N, G]
    rounding = 0.5 * sx.double() @ per_group.t()
    exact = x.double() @ wd.t()
    got = _product(w, x)
    assert_within(got, exact, rounding * (1 + 1e-6) + bound + 64 * U32 * (x.double().abs() @ wd.abs().t()))
    # And the bound is not vacuous: the error is a small part of the output's scale.
    assert float((got.double() - exact).abs().max()) < 0.02 * float(exact.abs().max())


@needs_kernel
def test_a_rows_output_is_the_same_alone_and_in_any_batch():
    w = _weight()
    x = _rows(33, seed=3)
    alone = torch.cat([_product(w, x[i : i + 1]) for i in range(33)])
    for size in range(2, 34):
        for start in sorted({0, (33 - size) // 2, 33 - size}):
            got = _product(w, x[start : start + size])
            assert torch.equal(got, alone[start : start + size]), (size, start)
    # Threads split the tiles differently; a tile's result is its own.
    prev = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(_product(w, x), alone)
    finally:
        torch.set_num_threads(prev)


@needs_kernel
def test_linear_and_matmul_take_the_int8_activation_path():
    w, x = _weight(), _rows(6)
    assert torch.equal(w.matmul(x), _product(w, x))
    plain = QuantizedWeight(quantize(w.dequantize(), "int4"), "cpu", native=True)
    assert plain.operands()[0] == 4  # the default keeps float activations
    w8 = QuantizedWeight(quantize(torch.randn(32, 64), "int8"), "cpu", native=True, activations="int8")
    assert w8.operands()[0] == 8 | qgemm.AQ8


# Builds of the kernel by vector flags: (name, flags, the CPU features it needs to run, its variant).
VARIANTS = [
    ("portable", [], [], 0),
    ("avx2", ["-mavx2", "-mfma", "-mf16c"], ["avx2", "fma", "f16c"], 1),
    (
        "avx512-vnni",
        ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
        ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"],
        2,
    ),
    ("avx-vnni", ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], ["avx2", "fma", "f16c", "avx_vnni"], 2),
]


@needs_kernel
@pytest.mark.parametrize("name,flags,needs,variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_each_variant_matches_this_cpus_build(tmp_path, name, flags, needs, variant):
    """Every variant builds (a compiler without the flag, or another architecture, skips it); those this
    CPU can run give this CPU's own build's results bit for bit: the same integers and the same float
    steps in the same order. The portable variant runs everywhere."""
    lib, fn = runnable_qgemm(tmp_path, name, flags, needs)
    lib.pd_qgemm_q8_variant.restype = ctypes.c_int
    assert lib.pd_qgemm_q8_variant() == variant
    for w in (_weight(), _weight8()):
        bits, t, d, m = w.operands()
        for rows in (1, 3, 9):
            x = _rows(rows, seed=rows)
            y = torch.empty(rows, N)
            ptrs = (t.data_ptr(), d.data_ptr(), m.data_ptr(), x.data_ptr())
            fn(bits, *ptrs, K, y.data_ptr(), N, rows, N, K, 1)
            assert torch.equal(y, w.matmul(x)), (name, bits, rows)


# ---------------------------------------------------------------- through a model


def _tiny_model(activations: str):
    from pdserve.model.arch import TINY_CONFIGS
    from pdserve.model.llama import LlamaModel
    from pdserve.model.loader import tiny_random_weights

    arch = TINY_CONFIGS["tiny-llama"]
    return LlamaModel(
        arch,
        tiny_random_weights(arch, 0),
        torch.float32,
        "cpu",
        1024,
        "int4",
        activation_quantization=activations,
    )


def _decode_logits(model, kv0, seqs, picked, prefill=0):
    """Logits of decode rows `picked` (indices into seqs: (blocks, context, token)), in one step, with a
    prefill of `prefill` tokens after them when asked (such a step runs op by op)."""
    from pdserve.model.attention import build_metadata

    chosen = sorted(picked, key=lambda i: seqs[i][1])
    spec = [(seqs[i][0], seqs[i][1] - 1, 1) for i in chosen]
    ids, pos = [seqs[i][2] for i in chosen], [seqs[i][1] - 1 for i in chosen]
    if prefill:
        spec.append(([60, 61], 0, prefill))
        ids += list(range(1, prefill + 1))
        pos += list(range(prefill))
    meta = build_metadata(spec, 16, model.arch.sliding_window, "cpu")
    out = model.forward(torch.tensor(ids), torch.tensor(pos), meta, kv0.clone(), torch.arange(len(ids)))
    return {i: out[j] for j, i in enumerate(chosen)}


@needs_kernel
def test_a_sequences_logits_do_not_depend_on_the_step_around_it():
    """int4 with int8 activations: a decode row's logits alone, in steps of 2..33 rows, fused (one call)
    and op by op, and beside a prefill, bit for bit."""
    model = _tiny_model("int8")
    assert model.fused is not None
    a = model.arch
    g = torch.Generator().manual_seed(5)
    kv0 = torch.randn(a.num_layers, 2, 64 * 16, a.num_kv_heads, a.head_dim, generator=g)
    seqs = [([i], 3 + i % 13, int(torch.randint(0, a.vocab_size, (1,), generator=g))) for i in range(33)]
    seqs = [([i], 2 + i // 3, seqs[i][2]) for i in range(33)]  # contexts 2..12 within one block each
    alone = {i: _decode_logits(model, kv0, seqs, [i])[i] for i in range(33)}
    for size in (2, 5, 8, 9, 16, 33):
        picked = list(range(0, 33, max(1, 33 // size)))[:size]
        got = _decode_logits(model, kv0, seqs, picked)
        assert all(torch.equal(got[i], alone[i]) for i in picked), size
    fused, model.fused = model.fused, None
    try:
        got = _decode_logits(model, kv0, seqs, list(range(33)))
        assert all(torch.equal(got[i], alone[i]) for i in range(33)), "op by op"
        got = _decode_logits(model, kv0, seqs, [4, 20], prefill=7)
        assert all(torch.equal(got[i], alone[i]) for i in (4, 20)), "beside a prefill"
    finally:
        model.fused = fused


@needs_kernel
def test_the_models_int4_products_take_int8_activations_and_stay_close():
    """Every int4 weight of the model carries the flag (the fused layer reads it from there); the
    logits stay close to the float-activation model's."""
    from pdserve.model.quant import QuantizedWeight as QW

    a8, f32 = _tiny_model("int8"), _tiny_model("none")
    layer = a8.layers[0]
    int4 = [w for w in vars(layer).values() if isinstance(w, QW) and w.mode == "int4"]
    int4 += [w for w in vars(layer.mlp).values() if isinstance(w, QW) and w.mode == "int4"]
    assert len(int4) >= 3 and all(w.operands()[0] == 4 | qgemm.AQ8 for w in int4)
    a = a8.arch
    kv0 = torch.randn(
        a.num_layers, 2, 64 * 16, a.num_kv_heads, a.head_dim, generator=torch.Generator().manual_seed(2)
    )
    seqs = [([i], 2 + i, 7 * i + 1) for i in range(8)]
    x, y = _decode_logits(a8, kv0, seqs, range(8)), _decode_logits(f32, kv0, seqs, range(8))
    for i in range(8):
        assert not torch.equal(x[i], y[i])  # the mode is in effect
        assert float((x[i] - y[i]).abs().max()) < 0.05 * float(y[i].abs().max())


def test_a_bad_activation_quantization_exits_2_naming_the_key(tmp_path):
    import sys
    from pathlib import Path

    from pdserve.config import ConfigError, load_config

    f = tmp_path / "c.yaml"
    f.write_text("model:\n  activation_quantization: int4\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    [(key, msg)] = e.value.problems
    assert key == "model.activation_quantization" and "'int4'" in msg and "int8" in msg
    f.write_text("model:\n  activation_quantization: int8\n")
    assert load_config(f).model.activation_quantization == "int8"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--activation-quantization", "fp8", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert r.returncode == 2 and "'fp8'" in r.stderr and "int8" in r.stderr, r.stderr


def _tiny_moe(activations: str):
    from pdserve.config import ModelConfig
    from pdserve.model.loader import build_model, load_model_files

    mc = ModelConfig(name="tiny-mixtral", quantization="int4", activation_quantization=activations)
    return build_model(
        load_model_files("tiny-mixtral", quantization="int4"), "float32", model_config=mc
    ).model


@needs_kernel
def test_a_moe_models_experts_take_int8_activations():
    """The experts' stacks carry the flag (the grouped kernel and the slot loop read it there), so the
    model's logits move off the float-activation model's, a little."""
    model = _tiny_moe("int8")
    stacks = [s for pair in model.expert_store for s in pair]
    assert stacks and all(s.operands()[0] == 4 | qgemm.AQ8 for s in stacks)
    a = model.arch
    kv0 = torch.randn(
        a.num_layers, 2, 64 * 16, a.num_kv_heads, a.head_dim, generator=torch.Generator().manual_seed(6)
    )
    seqs = [([i], 2 + i, 5 * i + 3) for i in range(4)]
    got, ref = (
        _decode_logits(model, kv0, seqs, range(4)),
        _decode_logits(_tiny_moe("none"), kv0, seqs, range(4)),
    )
    for i in range(4):
        assert not torch.equal(got[i], ref[i])
        assert float((got[i] - ref[i]).abs().max()) < 0.05 * float(ref[i].abs().max())


@needs_kernel
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_routed_experts_rows_are_their_own_in_the_grouped_kernel_and_the_loop(mode):
    """A token's routed-expert output with int8 activations: the same alone and among 2..33 tokens (its
    experts' other rows change), through moe.c and the slot-by-slot path."""
    from pdserve.eplb.placement import LayerPlacement
    from pdserve.model.experts import ExpertStack
    from pdserve.model.moe import routed_experts, routed_experts_loop

    e, h, inter, k = 8, 64, 96, 2
    g = torch.Generator().manual_seed(7)
    gu = ExpertStack.pack(torch.randn(e, 2 * inter, h, generator=g) / 8, mode, torch.float32, "cpu")
    dn = ExpertStack.pack(torch.randn(e, h, inter, generator=g) / 10, mode, torch.float32, "cpu")
    gu, dn = gu.with_activations("int8"), dn.with_activations("int8")
    pl = LayerPlacement.build(torch.arange(e), e, 0, e, gu, dn)
    x = torch.randn(33, h, generator=g)
    slots = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(33)])
    weights = torch.rand(33, k, generator=g)
    alone = torch.cat(
        [routed_experts(x[i : i + 1], slots[i : i + 1], weights[i : i + 1], pl) for i in range(33)]
    )
    for size in (2, 5, 9, 17, 33):
        for fn in (routed_experts, routed_experts_loop):
            got = fn(x[:size], slots[:size], weights[:size], pl)
            assert torch.equal(got, alone[:size]), (size, fn.__name__)


def test_kv_tiers_keep_int8_activation_blocks_apart():
    """A shared disk or Redis tier names blocks by what shaped them: int8 activations write other KV,
    so their namespace differs; the default's is the digest, dtype, length, quantization and the
    cache's dtype (bfloat16 over the file's int4 weights) alone."""
    import dataclasses
    import hashlib

    from pdserve.config import Config
    from pdserve.engine.tier_identity import tier_namespace
    from pdserve.model.stored_quant import resolve_quantization

    cfg = Config()
    a8 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, activation_quantization="int8"))
    digest = "d" * 32
    assert tier_namespace(a8, 2048, digest) != tier_namespace(cfg, 2048, digest)
    quant = resolve_quantization(cfg.model.quantization, cfg.model.name)
    key = f"{digest}|float32|2048|{quant}|kv=bfloat16".encode()
    assert (
        tier_namespace(cfg, 2048, digest) == "smollm2-135m-" + hashlib.blake2b(key, digest_size=6).hexdigest()
    )
