"""The fused decode layer (kernels/layer.c) against the op-by-op layer: the same logits and the same
KV cache writes bit for bit, for every weight format and the architectures it takes; the steps and
models it does not take run op by op."""

import math

import pytest
import torch
from float_bounds import U32, assert_within

from pdserve.model.arch import TINY_CONFIGS
from pdserve.model.attention import build_metadata
from pdserve.model.kernels import layer as fused_kernels
from pdserve.model.llama import LlamaModel
from pdserve.model.loader import tiny_random_weights

needs_kernel = pytest.mark.skipif(
    not fused_kernels.available(), reason="no C compiler here: layers run op by op"
)
BLOCK = 16


def _model(name, quantization, seed=0):
    arch = TINY_CONFIGS[name]
    return LlamaModel(arch, tiny_random_weights(arch, seed), torch.float32, "cpu", 1024, quantization)


def _step(model, lens, seed=1, prefill=0, kv_dtype=torch.float32, prefix=0):
    """A step of decodes with contexts `lens` over a random cache (plus one prefill chunk of that many
    tokens, after `prefix` tokens already in the cache)."""
    g = torch.Generator().manual_seed(seed)
    a = model.arch
    blocks = 8 + sum(-(-n // BLOCK) for n in lens) + -(-(prefix + prefill) // BLOCK)
    kv = torch.randn(a.num_layers, 2, blocks * BLOCK, a.num_kv_heads, a.head_dim, generator=g).to(kv_dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    seqs, positions, p = [], [], 0
    for n in sorted(lens):
        nb = -(-n // BLOCK)
        seqs.append((perm[p : p + nb], n - 1, 1))
        positions.append(n - 1)
        p += nb
    if prefill:
        seqs.append((perm[p : p + -(-(prefix + prefill) // BLOCK)], prefix, prefill))
        positions += range(prefix, prefix + prefill)
    meta = build_metadata(seqs, BLOCK, a.sliding_window, "cpu")
    ids = torch.randint(0, a.vocab_size, (len(positions),), generator=g)
    return ids, torch.tensor(positions), meta, kv


def _both(model, ids, positions, meta, kv):
    last = torch.arange(len(ids))
    fused = model.fused
    got_kv = kv.clone()
    got = model.forward(ids, positions, meta, got_kv, last)
    model.fused = None
    try:
        want_kv = kv.clone()
        want = model.forward(ids, positions, meta, want_kv, last)
    finally:
        model.fused = fused
    return got, got_kv, want, want_kv


@needs_kernel
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize(
    "name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"]
)  # plain, qkv bias, sliding window
@pytest.mark.parametrize(
    "lens",
    [
        [5],
        [3, 9],
        [2, 17, 17, 40, 41, 100, 300, 301, 33, 64],
        [3 + 5 * i for i in range(34)],
        [1000],
        [700, 9, 1000],
    ],
    ids=["one", "two", "ten", "34", "one-long", "long"],
)  # bfloat16 products where the CPU has them: int4 and int8 from ten rows; long contexts
def test_fused_decode_step_is_the_op_by_op_step_bit_for_bit(name, quantization, lens):
    model = _model(name, quantization)
    assert model.fused is not None
    ids, positions, meta, kv = _step(model, lens)
    got, got_kv, want, want_kv = _both(model, ids, positions, meta, kv)
    assert torch.equal(got, want)
    assert torch.equal(got_kv, want_kv)
    assert not torch.equal(got_kv, kv)  # the step wrote its keys and values


@needs_kernel
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
@pytest.mark.parametrize("lens", [[2, 17, 17, 40, 41, 100, 300, 301, 33, 64], [7]], ids=["ten", "one"])
def test_a_bfloat16_cache_fused_and_op_by_op_agree_bit_for_bit(name, quantization, lens):
    """cache.kv_dtype bfloat16: layer.c rounds the step's keys and values as torch does and attends to
    the widened cache as the op-by-op path's kernel does: the same logits and cache bits."""
    model = _model(name, quantization)
    ids, positions, meta, kv = _step(model, lens, kv_dtype=torch.bfloat16)
    got, got_kv, want, want_kv = _both(model, ids, positions, meta, kv)
    assert got_kv.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert torch.equal(got_kv, want_kv)
    assert not torch.equal(got_kv, kv)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])  # 3 on 2 cores: barriers wait on descheduled threads
def test_one_call_for_the_stack_per_layer_calls_and_any_thread_count_agree(threads):
    """The whole stack in one parallel region, the per-layer calls a layer hook needs, and the
    op-by-op step: the same logits and cache, whatever the number of threads sharing the work."""
    model = _model("tiny-qwen2", "int4")
    ids, positions, meta, kv = _step(model, [2, 17, 40, 41, 100, 300, 33, 64, 5, 9, 12])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, got_kv, want, want_kv = _both(model, ids, positions, meta, kv)
        done: list[int] = []
        hooked_kv = kv.clone()
        hooked = model.forward(
            ids, positions, meta, hooked_kv, torch.arange(len(ids)), layer_done=done.append
        )
    finally:
        torch.set_num_threads(before)
    assert done == list(range(model.arch.num_layers))
    assert torch.equal(got, want) and torch.equal(hooked, want)
    assert torch.equal(got_kv, want_kv) and torch.equal(hooked_kv, want_kv)


@needs_kernel
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,prefill,prefix",
    [([], 5, 0), ([4, 30], 20, 0), ([9], 40, 37), ([], 200, 0), ([3, 17, 100], 3, 64)],
    ids=["short-prompt", "decodes-and-prompt", "after-context", "long-prompt", "short-after-context"],
)
def test_steps_with_prefill_chunks_fused_and_op_by_op_agree_bit_for_bit(
    name, quantization, kv_dtype, lens, prefill, prefix
):
    """A step with a prefill chunk (alone, beside decodes, after cached context; fewer rows than
    layer.c's shared phases and more) runs in layer.c, its chunk through the prefill kernel as the
    op-by-op path's: the same logits and cache bits."""
    model = _model(name, quantization)
    ids, positions, meta, kv = _step(model, lens, prefill=prefill, kv_dtype=kv_dtype, prefix=prefix)
    assert fused_kernels.FusedStep.applies(meta, len(ids), fused_kernels.prefill_rows(model.fused))
    got, got_kv, want, want_kv = _both(model, ids, positions, meta, kv)
    assert torch.equal(got, want)
    assert torch.equal(got_kv, want_kv)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_windows_prefill_chunks_fused_and_op_by_op_agree(kv_dtype):
    """A window shorter than the chunk and its context: the chunk's rows see only their window's keys
    in layer.c as op by op."""
    tiny = TINY_CONFIGS["tiny-mistral"]
    arch = tiny.__class__(**{**tiny.__dict__, "sliding_window": 24})
    model = LlamaModel(arch, tiny_random_weights(arch, 0), torch.float32, "cpu", 1024, "int4")
    ids, positions, meta, kv = _step(model, [9, 70], prefill=50, kv_dtype=kv_dtype, prefix=40)
    assert fused_kernels.FusedStep.applies(meta, len(ids), fused_kernels.prefill_rows(model.fused))
    got, got_kv, want, want_kv = _both(model, ids, positions, meta, kv)
    assert torch.equal(got, want)
    assert torch.equal(got_kv, want_kv)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 24], ids=["heads-of-four-tiles", "heads-across-tiles"])
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_qkv_products_heads_finish_as_op_by_op_at_any_head_width(
    head_dim, quantization, kv_dtype, threads
):
    """The QKV product's heads get their bias, rotary embedding and cache write from the thread that
    computed them (heads of whole 16-column tiles), or in a phase of their own (heads across tiles);
    the residual adds follow their products' columns: the op-by-op step's logits and cache bits."""
    tiny = TINY_CONFIGS["tiny-qwen2"]  # with a QKV bias
    arch = tiny.__class__(**{**tiny.__dict__, "head_dim": head_dim})
    model = LlamaModel(arch, tiny_random_weights(arch, 0), torch.float32, "cpu", 1024, quantization)
    assert model.fused is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens, prefill in (([3], 0), ([2, 17, 40, 300, 5, 9, 12, 33, 64, 100], 0), ([9, 70], 30)):
            ids, positions, meta, kv = _step(
                model, lens, prefill=prefill, kv_dtype=kv_dtype, prefix=10 * bool(prefill)
            )
            got, got_kv, want, want_kv = _both(model, ids, positions, meta, kv)
            assert torch.equal(got, want)
            assert torch.equal(got_kv, want_kv)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_prefill_steps_layers_agree_on_any_thread_count(threads):
    """The chunk's attention tasks shared out beside the decodes', the shared norms and SiLU phases:
    one call for the stack, a call a layer (a prefill worker's layer hook) and op by op agree."""
    model = _model("tiny-qwen2", "int4")
    ids, positions, meta, kv = _step(model, [2, 17, 40, 300], prefill=60, prefix=20)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, got_kv, want, want_kv = _both(model, ids, positions, meta, kv)
        hooked_kv = kv.clone()
        hooked = model.forward(
            ids, positions, meta, hooked_kv, torch.arange(len(ids)), layer_done=lambda i: None
        )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want) and torch.equal(hooked, want)
    assert torch.equal(got_kv, want_kv) and torch.equal(hooked_kv, want_kv)


@needs_kernel
def test_steps_past_the_fused_prefill_rows_run_op_by_op(monkeypatch):
    """Past FUSED_PREFILL_BYTES of scratch (here a smaller bound, as a wider model's), and without the
    prefill kernel, a step with a prefill chunk runs op by op."""
    model = _model("tiny-llama", "none")
    monkeypatch.setattr(fused_kernels, "FUSED_PREFILL_BYTES", 4 * 64 * model.fused.scratch_per_row)
    rows = fused_kernels.prefill_rows(model.fused)
    assert 0 < rows < 64
    ids, positions, meta, kv = _step(model, [4, 30], prefill=rows - 2)
    assert fused_kernels.FusedStep.applies(meta, len(ids), rows)
    assert not fused_kernels.FusedStep.applies(meta, len(ids))  # without the prefill kernel
    ids, positions, meta, kv = _step(model, [4, 30], prefill=rows - 1)
    assert not fused_kernels.FusedStep.applies(meta, len(ids), rows)
    monkeypatch.setattr(fused_kernels.FusedStep, "run", lambda *a: pytest.fail("fused past its rows"))
    monkeypatch.setattr(fused_kernels.FusedStep, "run_all", lambda *a: pytest.fail("fused past its rows"))
    model.forward(ids, positions, meta, kv, torch.arange(len(ids)))


def test_models_layer_c_does_not_take_run_op_by_op():
    # q/k norms (Qwen3): not in layer.c. A weight that is not qgemm.c's (the torch kernel): neither.
    arch = TINY_CONFIGS["tiny-qwen3-moe"].__class__(
        **{**TINY_CONFIGS["tiny-llama"].__dict__, "qk_norm": True}
    )
    assert LlamaModel(arch, tiny_random_weights(arch, 0), torch.float32, "cpu", 256).fused is None
    arch = TINY_CONFIGS["tiny-llama"]
    assert (
        LlamaModel(arch, tiny_random_weights(arch, 0), torch.float32, "cpu", 256, gemm_kernel="torch").fused
        is None
    )


@needs_kernel
def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(37, 2 * 1539, generator=g) * 6  # both signs, large magnitudes, a non-multiple of 8
    gu[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gu.chunk(2, dim=-1)
    got = fused_kernels.silu_mul(gu)
    want = torch.nn.functional.silu(gate.double()) * up.double()
    # exp (a few ulp), 1 + e, the division and the product: 16 roundings covers them with room. The
    # kernel's exp clamps its argument at -87 (vec.h): below it silu(x) ~ x e^x is off by |x up| e^-87.
    floor = 2 * math.exp(-87) * (gate.double() * up.double()).abs()
    assert_within(got, want, 16 * U32 * want.abs() + floor, "silu(gate) * up")
