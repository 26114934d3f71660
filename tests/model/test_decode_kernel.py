"""The native decode-attention kernel and torch's path, each against a float64 reference within the
rounding bound of its inputs, on ragged contexts, sliding windows and grouped heads; each decode's
attended range read off its mask; a machine without a compiler keeps the torch path."""

import pytest
import torch
from float_bounds import assert_within, attention64, attention_bound
from kernel_builds import AVX2, AVX2_NEEDS, build_library
from paged_cache import random_cache

from pdserve.model.attention import build_metadata, paged_attention
from pdserve.model.kernels import native
from pdserve.model.kernels.decode_attention import ARGTYPES, DecodeAttention, decode_attention_kernel
from pdserve.utils.cpu import cpu_flags

kernel = decode_attention_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler here: the torch path runs instead")


def _case(lens, window, heads=(9, 3), block=16, seed=0, dim=64, tables=None):
    """A decode step over `lens`; `tables`, a list given, receives each sequence's block table."""
    tables = [] if tables is None else tables
    g = torch.Generator().manual_seed(seed)
    h, kvh = heads
    blocks = 64 + sum(-(-n // block) for n in lens)
    kc, vc = (
        torch.randn(blocks * block, kvh, dim, generator=g),
        torch.randn(blocks * block, kvh, dim, generator=g),
    )
    perm = torch.randperm(blocks, generator=g).tolist()
    seqs, p = [], 0
    for n in sorted(lens):
        nb = -(-n // block)
        seqs.append((perm[p : p + nb], n - 1, 1))
        p += nb
    meta = build_metadata(seqs, block, window, "cpu")
    tables[:] = [table for table, _, _ in seqs]
    t = len(lens)
    q = torch.randn(t, h + kvh, dim, generator=g)[:, :h]  # a strided view, as the model passes it
    k, v = torch.randn(t, kvh, dim, generator=g), torch.randn(t, kvh, dim, generator=g)
    return q, k, v, kc, vc, meta


def _rows(q, k, v, kc, vc, lens, window, tables, block=16):
    """Each (decode, head) as one query row with its own keys: the cache as the step leaves it, read
    through the sequences' block tables."""
    kc, vc = kc.clone(), vc.clone()
    t, h = q.shape[0], q.shape[1]
    kvh, dim = kc.shape[1], kc.shape[2]
    width = max(lens)
    keys, vals = torch.zeros(t, kvh, width, dim), torch.zeros(t, kvh, width, dim)
    keep = torch.zeros(t, width, dtype=torch.bool)
    for i, (n, table) in enumerate(zip(sorted(lens), tables)):
        slots = torch.tensor([table[j // block] * block + j % block for j in range(n)])
        kc[slots[-1]], vc[slots[-1]] = k[i], v[i]
        keys[i, :, :n], vals[i, :, :n] = kc[slots].transpose(0, 1), vc[slots].transpose(0, 1)
        keep[i, max(0, n - window) if window else 0 : n] = True
    group = h // kvh
    rk = keys.repeat_interleave(group, 1).reshape(t * h, width, dim)
    rv = vals.repeat_interleave(group, 1).reshape(t * h, width, dim)
    return q.reshape(t * h, dim), rk, rv, keep.repeat_interleave(h, 0)


def _check_both(
    lens, window=None, heads=(9, 3), dim=64, q_scale=1.0, kernel_scale=None, kernel_fn=kernel, block=16
):
    """torch's path and the kernel, each against float64 within the bound; returns nothing."""
    tables = []
    q, k, v, kc, vc, meta = _case(lens, window, heads, block=block, dim=dim, tables=tables)
    q = q * q_scale
    scale = dim**-0.5
    rq, rk, rv, keep = _rows(q, k, v, kc, vc, lens, window, tables, block)
    want = attention64(rq, rk, rv, keep, scale).reshape(q.shape)
    bound = attention_bound(rq, rk, rv, keep, scale).reshape(q.shape)
    torch_out = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, scale)
    assert_within(torch_out, want, bound, "torch's path")
    got = paged_attention(q, k, v, kc, vc, meta, scale if kernel_scale is None else kernel_scale, kernel_fn)
    assert_within(got, want, bound, "the kernel")


# Decodes only (a context of 1 is a prefill). The small step runs on the calling thread, the large
# one (32 x 130 x 9 position-heads) across the pool; LONG's few sequences a KV head a task.
SMALL = [2, 3, 15, 16, 17, 33, 200, 251, 64, 100]
LARGE = [130] * 24 + [5, 70, 300, 301, 16, 17, 32, 33]
LONG = [257, 512, 513, 1000, 2049, 40]


@needs_kernel
@pytest.mark.parametrize("window", [None, 40, 600])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("lens", [SMALL, LARGE, LONG], ids=["small", "large", "long"])
def test_kernel_matches_float64(window, heads, lens):
    assert len(_case(lens, window, heads)[5].decode_groups) > 1
    _check_both(lens, window, heads)


@needs_kernel
def test_a_sequences_outputs_do_not_depend_on_its_batch():
    """A sequence decoding alone, beside one other or among 32 (where a task takes all its KV heads,
    not one): the same bits."""
    lens = [1000] + [130] * 31
    tables = []
    q, k, v, kc, vc, meta = _case(lens, None, tables=tables)
    scale = 64**-0.5
    full = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, scale, kernel)
    ordered = sorted(lens)
    row = ordered.index(1000)
    for keep in ([row], [0, row]):
        m = build_metadata([(tables[i], ordered[i] - 1, 1) for i in keep], 16, None, "cpu")
        got = paged_attention(q[keep], k[keep], v[keep], kc.clone(), vc.clone(), m, scale, kernel)
        assert torch.equal(got[-1], full[row])


@needs_kernel
@pytest.mark.parametrize("dim", [64, 40, 128])
def test_outputs_do_not_depend_on_how_heads_are_split_into_tasks(dim):
    """A task covers one KV head of a sequence or all of them (pd_attend_heads: all once there are
    4 sequences a thread); either way, and on any number of threads, the same bits."""
    q, k, v, kc, vc, meta = _case(LARGE, None, dim=dim)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 16):  # 32 sequences: whole sequences up to 8 threads, heads at 16
            torch.set_num_threads(threads)
            outs.append(paged_attention(q, k, v, kc.clone(), vc.clone(), meta, dim**-0.5, kernel))
    finally:
        torch.set_num_threads(before)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def _chains_case(chains, dim, kv_dtype, block=16, seed=0):
    """A step of verify-like chains: (context, rows) per request, its rows attending one more position
    each through one block table, in the order the engine keeps them (a request's rows adjacent)."""
    g = torch.Generator().manual_seed(seed)
    h, kvh = 9, 3
    kc, vc, perm = random_cache(
        g, 8 + sum(-(-(n + r) // block) for n, r in chains), block, kvh, dim, kv_dtype
    )
    seqs, p = [], 0
    for n, r in chains:
        nb = -(-(n + r) // block)
        table = perm[p : p + nb]
        p += nb
        seqs += [(table, n - 1 + j, 1) for j in range(r)]
    t = len(seqs)
    q = torch.randn(t, h + kvh, dim, generator=g)[:, :h]
    k, v = torch.randn(t, kvh, dim, generator=g), torch.randn(t, kvh, dim, generator=g)
    return seqs, q, k, v, kc, vc


# (context of a chain's first row, rows): alone, past RUN_MAX (17), across blocks, beside plain decodes
CHAINS = [(5, 1), (14, 5), (40, 1), (60, 20), (100, 3), (130, 17), (131, 1), (300, 9)]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40, 36])
@pytest.mark.parametrize("threads", [1, 2, 16])  # walks of 17 rows, 14, 1
def test_a_chains_rows_give_what_each_alone_gives(kv_dtype, dim, threads):
    """A request's verify rows (one table, one more position each) are attended in one walk of their
    context: each row's outputs are the bits it gives attended alone, with the cache as the step left
    it, and within the float64 bound."""
    seqs, q, k, v, kc, vc = _chains_case(CHAINS, dim, kv_dtype)
    scale = dim**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        meta = build_metadata(seqs, 16, None, "cpu")
        full = paged_attention(q, k, v, kc, vc, meta, scale, kernel)  # kc, vc: the step's writes kept
        for i, (table, computed, _) in enumerate(seqs):
            alone = build_metadata([(table, computed, 1)], 16, None, "cpu")
            got = paged_attention(
                q[i : i + 1], k[i : i + 1], v[i : i + 1], kc.clone(), vc.clone(), alone, scale, kernel
            )
            assert torch.equal(got[0], full[i]), f"row {i} (context {computed + 1})"
    finally:
        torch.set_num_threads(before)
    # against float64: each row's keys and values read through its table from the cache as left
    width = max(c for _, c, _ in seqs) + 1
    rk = torch.zeros(len(seqs), 3, width, dim, dtype=torch.float64)
    rv = torch.zeros_like(rk)
    keep = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (table, computed, _) in enumerate(seqs):
        slots = torch.tensor([table[j // 16] * 16 + j % 16 for j in range(computed + 1)])
        rk[i, :, : computed + 1] = kc[slots].double().transpose(0, 1)
        rv[i, :, : computed + 1] = vc[slots].double().transpose(0, 1)
        keep[i, : computed + 1] = True
    rq = q.reshape(-1, dim)
    rk = rk.repeat_interleave(3, 1).reshape(-1, width, dim)
    rv = rv.repeat_interleave(3, 1).reshape(-1, width, dim)
    keep = keep.repeat_interleave(9, 0)
    want = attention64(rq, rk, rv, keep, scale).reshape(q.shape)
    assert_within(full, want, attention_bound(rq, rk, rv, keep, scale).reshape(q.shape), "chains")


@needs_kernel
@pytest.mark.parametrize("dim", [36, 40, 128])  # scalar loops, 8-wide without the 64 path, 8-wide
def test_kernel_matches_float64_at_other_head_dims(dim):
    _check_both(LARGE, dim=dim)


@needs_kernel
@pytest.mark.parametrize("block", [8, 32])
@pytest.mark.parametrize("lens", [SMALL, LARGE], ids=["small", "large"])
def test_kernel_matches_float64_at_other_block_sizes(block, lens):
    """Scores are computed a run of 8 or 16 rows at a time within a block: blocks of 8 leave a
    16-row run short, blocks of 32 hold two."""
    _check_both(lens, 40 if lens is SMALL else None, block=block)


# The builds other CPUs run: 8-lane score folds and one head a pass (AVX2), and no vector flags.
OTHER_BUILDS = [("portable", [], []), ("avx2", AVX2, AVX2_NEEDS)]


def _other_build(tmp_path, name, flags, needs) -> DecodeAttention:
    """The kernel built with `flags`, typed; skips where this CPU cannot run it. A build this CPU could
    run must succeed (the portable one everywhere)."""
    runs_here = set(needs) <= cpu_flags()
    lib = build_library(tmp_path, name, ["decode_attention"], flags)
    if lib is None:
        assert flags and not runs_here, f"the {name} build failed"
        pytest.skip(f"{name}: this compiler or architecture does not take {flags}")
    if not runs_here:
        pytest.skip(f"{name} built; this CPU cannot run it")
    fn = lib.pd_decode_attention
    fn.restype, fn.argtypes = None, ARGTYPES
    return DecodeAttention(fn)


@needs_kernel
@pytest.mark.parametrize("name,flags,needs", OTHER_BUILDS, ids=[b[0] for b in OTHER_BUILDS])
def test_other_vector_builds_match_float64(tmp_path, name, flags, needs):
    other = _other_build(tmp_path, name, flags, needs)
    for dim, block in ((64, 16), (40, 16), (64, 8)):
        _check_both(LARGE, dim=dim, block=block, kernel_fn=other)
    _check_both(SMALL, 40, kernel_fn=other)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (14, 2)])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_the_avx2_build_gives_this_builds_bits(tmp_path, dim, heads, kv_dtype):
    """The 8-lane score folds are the 16-lane ones' tree (two chains over a row's even and odd eights,
    then lanes j + 4, + 2, + 1), and the value sums run in position order at either width, whether
    a bfloat16 cache is widened into a copy (AVX2) or in registers (AVX-512): a PD deployment's
    workers on AVX2 and on AVX-512 attend alike."""
    avx2 = _other_build(tmp_path, "avx2", AVX2, AVX2_NEEDS)
    q, k, v, kc, vc, meta = _case(LARGE, None, heads, dim=dim)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    got = [paged_attention(q, k, v, kc.clone(), vc.clone(), meta, dim**-0.5, f) for f in (kernel, avx2)]
    assert torch.equal(got[0], got[1])


@needs_kernel
@pytest.mark.parametrize("lens", [LARGE, LONG], ids=["large", "long"])
def test_kernel_softmax_over_wide_score_ranges(lens):
    """Scores spread over hundreds (the kernel's own exp, its underflow clamp) stay within the bound,
    which grows with the scores' magnitudes: their last-bit differences are amplified by the exp."""
    _check_both(lens, q_scale=40.0)


def _skips_newest_key(q, kc, vc, block_idx, first, ctx, *rest):
    return kernel(q, kc, vc, block_idx, first, ctx - 1, *rest)


@needs_kernel
@pytest.mark.parametrize("q_scale", [1.0, 40.0])
def test_the_bound_rejects_a_kernel_error(q_scale):
    """The bound is tight enough to catch real faults: a kernel that stops one key short (an
    off-by-one in its range) fails it, and so, with ordinary scores, does a scale off by one part in a
    thousand (with scores spread over hundreds the weights are one-hot and the scale barely counts)."""
    with pytest.raises(AssertionError, match="the kernel"):
        _check_both(LARGE, q_scale=q_scale, kernel_fn=_skips_newest_key)
    if q_scale == 1.0:
        with pytest.raises(AssertionError, match="the kernel"):
            _check_both(LARGE, q_scale=q_scale, kernel_scale=64**-0.5 * 1.001)


def test_bounds_read_off_the_mask():
    lens = [3, 40, 41, 90]
    meta = _case(lens, 32)[5]
    got = [x for g in meta.decode_groups for x in zip(*(t.tolist() for t in g.attended()))]
    assert got == [(max(0, n - 32), n) for n in sorted(lens)]


def test_no_compiler_keeps_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load("decode_attention") is None
    finally:
        native.load.cache_clear()


@needs_kernel
def test_build_is_cached_per_feature_set(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    first = native.build("decode_attention")
    assert first.exists() and native.build("decode_attention") == first
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math would set flush-to-zero for the whole process as it loads."""
    assert native.load("decode_attention") is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float((tiny * 1.0)[0]) != 0.0 and 1e-310 * 1.0 != 0.0


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.mark.parametrize("window", [None, 40])
# query heads a KV head: 1 to 4 (read in place, a KV head's query heads at once), 7 and 8 (in groups)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (4, 2), (8, 2), (14, 2), (8, 1)])
@pytest.mark.parametrize("lens", [SMALL, LARGE, LONG], ids=["small", "large", "long"])
def test_a_bfloat16_cache_is_attended_as_its_rounded_values(lens, heads, window):
    """cache.kv_dtype bfloat16: the step's keys and values go in rounded, and torch's path and the
    kernel both attend to the rounded cache (float64 reference of the rounded values, within the
    bound); the kernel's widened reads give the bits it computes from a float32 cache holding them.
    A window starts the walk mid-block, as the rows prefetched ahead of it do not."""
    tables = []
    q, k, v, kc, vc, meta = _case(lens, window, heads, tables=tables)
    scale = q.shape[-1] ** -0.5
    rq, rk, rv, keep = _rows(q, _rounded(k), _rounded(v), _rounded(kc), _rounded(vc), lens, window, tables)
    want = attention64(rq, rk, rv, keep, scale).reshape(q.shape)
    bound = attention_bound(rq, rk, rv, keep, scale).reshape(q.shape)
    for fn in (None, kernel) if kernel is not None else (None,):
        kcb, vcb = kc.bfloat16(), vc.bfloat16()
        got = paged_attention(q, k, v, kcb, vcb, meta, scale, fn)
        assert_within(got, want, bound, "the kernel" if fn else "torch's path")
        assert torch.equal(kcb[meta.slot_mapping], k.bfloat16())
        assert torch.equal(vcb[meta.slot_mapping], v.bfloat16())
    if kernel is not None:
        widened = paged_attention(
            q, _rounded(k), _rounded(v), _rounded(kc), _rounded(vc), meta, scale, kernel
        )
        assert torch.equal(got, widened)
