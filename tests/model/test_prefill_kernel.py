"""The native prefill-attention kernel against a float64 reference within the rounding bound of its
inputs: prompts' first chunks, chunks after cached context (both the short, masked form and the
long, prefix form), several chunks and decodes in one step, grouped heads, sliding windows, a
bfloat16 cache and wide score ranges. A query's bits do not depend on how its prompt was chunked,
on the other chunks of its step, or on the number of threads."""

import ctypes

import pytest
import torch
from float_bounds import assert_within, attention64, attention_bound
from kernel_builds import AVX2, AVX2_NEEDS, build_library
from paged_cache import random_cache

from pdserve.model.attention import build_metadata, paged_attention
from pdserve.model.kernels.decode_attention import decode_attention_kernel
from pdserve.model.kernels.prefill_attention import PrefillAttention, prefill_attention_kernel
from pdserve.utils.cpu import cpu_flags

kernel = prefill_attention_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler here: the torch path runs instead")
BLOCK = 16


def _case(specs, heads=(9, 3), dim=64, window=None, kv_dtype=torch.float32, q_scale=1.0, seed=0):
    """A step of sequences (computed, new): new == 1 after context is a decode, else a prefill chunk.
    The cache holds random keys and values for every computed position; the step's own are fresh."""
    g = torch.Generator().manual_seed(seed)
    h, kvh = heads
    kc, vc, perm = random_cache(g, 8 + sum(-(-(c + n) // BLOCK) for c, n in specs), BLOCK, kvh, dim, kv_dtype)
    seqs, p = [], 0
    for c, n in specs:
        nb = -(-(c + n) // BLOCK)
        seqs.append((perm[p : p + nb], c, n))
        p += nb
    # build_metadata's order: decodes first, shortest context first
    decodes = sorted((s for s in seqs if s[2] == 1 and s[1] > 0), key=lambda s: s[1] + 1)
    seqs = decodes + [s for s in seqs if not (s[2] == 1 and s[1] > 0)]
    t = sum(n for _, _, n in seqs)
    q = torch.randn(t, h + kvh, dim, generator=g)[:, :h] * q_scale  # a strided view, as the model passes it
    k, v = torch.randn(t, kvh, dim, generator=g), torch.randn(t, kvh, dim, generator=g)
    return q, k, v, kc, vc, seqs


def _reference(q, k, v, kc, vc, seqs, window, scale):
    """Every (row, head) in float64 over the keys it sees, and the rounding bound, [T, H, D] each."""
    meta = build_metadata(seqs, BLOCK, window, "cpu")
    kc, vc = kc.clone(), vc.clone()
    kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
    vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
    kc, vc = kc.double(), vc.double()
    h, group = q.shape[1], q.shape[1] // kc.shape[1]
    want, bound, row = [], [], 0
    for table, c, n in seqs:
        slots = torch.tensor([table[j // BLOCK] * BLOCK + j % BLOCK for j in range(c + n)])
        keys = kc[slots].repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
        vals = vc[slots].repeat_interleave(group, 1).transpose(0, 1)
        for i in range(n):
            pos = c + i
            keep = torch.zeros(c + n, dtype=torch.bool)
            keep[max(0, pos - window + 1) if window else 0 : pos + 1] = True
            keep = keep.expand(h, -1)
            want.append(attention64(q[row + i], keys, vals, keep, scale))
            bound.append(attention_bound(q[row + i], keys, vals, keep, scale))
        row += n
    return torch.stack(want), torch.stack(bound)


def _run(q, k, v, kc, vc, seqs, window, scale, fn=kernel, decodes=None):
    """paged_attention over the step, the prefill kernel given (with the decode kernel, if asked)."""
    meta = build_metadata(seqs, BLOCK, window, "cpu")
    if fn is not None:
        fn.window = window or 0
    return paged_attention(q, k, v, kc.clone(), vc.clone(), meta, scale, decodes, fn)


def _check(
    specs, heads=(9, 3), dim=64, window=None, kv_dtype=torch.float32, q_scale=1.0, fn=kernel, scale=None
):
    q, k, v, kc, vc, seqs = _case(specs, heads, dim, window, kv_dtype, q_scale)
    true_scale = dim**-0.5
    want, bound = _reference(q, k, v, kc, vc, seqs, window, true_scale)
    assert_within(_run(q, k, v, kc, vc, seqs, window, true_scale, None), want, bound, "torch's path")
    got = _run(
        q, k, v, kc, vc, seqs, window, true_scale if scale is None else scale, fn, decode_attention_kernel()
    )
    assert_within(got, want, bound, "the kernel")


FIRST = [(0, 128)]
MANY_FIRST = [(0, 1), (0, 5), (0, 37), (0, 128), (0, 200)]
AFTER_CONTEXT = [(300, 260), (17, 3), (64, 64), (0, 1), (90, 2)]  # 260 queries: the prefix form
WITH_DECODES = [(40, 1), (7, 1), (0, 70), (120, 33), (300, 1)]


@needs_kernel
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4), (14, 2)])
@pytest.mark.parametrize(
    "specs", [FIRST, MANY_FIRST, AFTER_CONTEXT, WITH_DECODES], ids=["first", "many", "after", "decodes"]
)
def test_kernel_matches_float64(specs, heads, window):
    _check(specs, heads, window=window)


@needs_kernel
@pytest.mark.parametrize(
    "dim", [32, 40, 80, 128]
)  # 40: not a multiple of AVX-512's width, torch's path there
def test_kernel_matches_float64_at_other_head_dims(dim):
    _check(AFTER_CONTEXT, dim=dim)


@needs_kernel
@pytest.mark.parametrize("window", [None, 70])
def test_a_bfloat16_cache_is_attended_as_its_rounded_values(window):
    """The reference reads the cache after the step's keys went in rounded; the kernel reads the
    context from the bfloat16 cache and the chunk's own keys as the rounded values paged_attention
    hands it."""
    _check(AFTER_CONTEXT, (32, 8), window=window, kv_dtype=torch.bfloat16)


@needs_kernel
def test_softmax_over_wide_score_ranges():
    """Scores spread over hundreds: the kernel's exp and its underflow clamp stay within the bound."""
    _check(AFTER_CONTEXT, q_scale=40.0)


@needs_kernel
def test_the_bound_rejects_a_kernel_error():
    """A scale off by one part in a thousand, or a window one key wider, fails the bound."""
    with pytest.raises(AssertionError, match="the kernel"):
        _check(AFTER_CONTEXT, scale=64**-0.5 * 1.001)
    wider = prefill_attention_kernel(41)
    q, k, v, kc, vc, seqs = _case(AFTER_CONTEXT, window=40)
    want, bound = _reference(q, k, v, kc, vc, seqs, 40, 0.125)
    meta = build_metadata(seqs, BLOCK, 40, "cpu")
    with pytest.raises(AssertionError, match="the kernel"):
        assert_within(paged_attention(q, k, v, kc, vc, meta, 0.125, None, wider), want, bound, "the kernel")


def _prompt(n, splits, heads=(9, 3), dim=64, seed=1):
    """One prompt's rows computed in chunks starting at `splits`: each chunk a step of its own over the
    cache the earlier chunks filled (the same keys and values throughout). Returns [n, H, D]."""
    g = torch.Generator().manual_seed(seed)
    h, kvh = heads
    q = torch.randn(n, h, dim, generator=g)
    k, v = torch.randn(n, kvh, dim, generator=g), torch.randn(n, kvh, dim, generator=g)
    nb = -(-n // BLOCK)
    table = list(range(nb))[::-1]  # blocks out of order
    kc, vc = torch.zeros(nb * BLOCK, kvh, dim), torch.zeros(nb * BLOCK, kvh, dim)
    out = []
    bounds = [*splits, n]
    for lo, hi in zip(bounds, bounds[1:]):
        meta = build_metadata([(table, lo, hi - lo)], BLOCK, None, "cpu")
        out.append(paged_attention(q[lo:hi], k[lo:hi], v[lo:hi], kc, vc, meta, dim**-0.5, None, kernel))
    return torch.cat(out)


@needs_kernel
@pytest.mark.parametrize("heads", [(9, 3), (32, 8)])
def test_a_querys_bits_do_not_depend_on_the_chunking(heads):
    """A prompt in one chunk, in chunks of 64 or 300, or after a prefix of 65 (a cache hit), on 1-3
    threads: the same bits for every row (superblocks sit at absolute positions)."""
    kernel.window = 0
    whole = _prompt(700, [0], heads)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for splits in ([0], [0, 64, 128, 192, 500], [0, 300, 600], [0, 65]):
                assert torch.equal(_prompt(700, splits, heads), whole), (threads, splits)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_a_chunks_bits_do_not_depend_on_the_other_chunks_of_its_step():
    q, k, v, kc, vc, seqs = _case(AFTER_CONTEXT)
    both = _run(q, k, v, kc, vc, seqs, None, 0.125)
    table, c, n = seqs[0]  # (300, 260): the first chunk of the step, rows [0, 260)
    alone = _run(q[:n], k[:n], v[:n], kc, vc, [(table, c, n)], None, 0.125)
    assert torch.equal(alone, both[:n])


@needs_kernel
def test_the_eight_wide_build_matches_float64(tmp_path):
    """The build a CPU without AVX-512 runs (eight lanes, other tiles), on this CPU where it can."""
    lib = build_library(tmp_path, "prefill_avx2", ["prefill_attention"], AVX2)
    if lib is None or not set(AVX2_NEEDS) <= cpu_flags():
        pytest.skip("no AVX2 build here, or this CPU cannot run it")
    lib.pd_prefill_attention_width.restype = ctypes.c_int
    assert lib.pd_prefill_attention_width() == 8
    fn = lib.pd_prefill_attention
    fn.restype = None
    fn.argtypes = kernel._fn.argtypes
    eight = PrefillAttention(fn, 8, 0)
    for heads in ((9, 3), (14, 2)):
        _check(AFTER_CONTEXT, heads, fn=eight)
        _check(WITH_DECODES, heads, dim=40, window=40, fn=eight)


@needs_kernel
def test_the_model_attends_prefills_natively_unless_told_not_to():
    """A float32 CPU model's layers carry the kernel (with its sliding window); attention_kernel: torch
    keeps torch's path for prefills as for decodes."""
    from pdserve.config import load_config
    from pdserve.engine.engine import LLMEngine

    for choice, native in (("auto", True), ("torch", False)):
        engine = LLMEngine(load_config(None, {"model.name": "tiny-llama", "model.attention_kernel": choice}))
        try:
            kernels = {layer.prefill_kernel for layer in engine.model.layers}
            assert len(kernels) == 1 and (kernels.pop() is not None) == native
        finally:
            engine.close()
