"""The native decode-attention kernel against torch's path: same outputs on ragged contexts, sliding
windows and grouped heads; each decode's attended range read off its mask; a
machine without a compiler keeps the torch path."""
import pytest
import torch

from pdserve.model.attention import build_metadata, paged_attention
from pdserve.model.kernels import native
from pdserve.model.kernels.decode_attention import decode_attention_kernel

kernel = decode_attention_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler here: the torch path runs instead")


def _case(lens, window, heads=(9, 3), block=16, seed=0, dim=64):
    g = torch.Generator().manual_seed(seed)
    h, kvh = heads
    blocks = 64 + sum(-(-n // block) for n in lens)
    kc, vc = torch.randn(blocks * block, kvh, dim, generator=g), torch.randn(blocks * block, kvh, dim, generator=g)
    perm = torch.randperm(blocks, generator=g).tolist()
    seqs, p = [], 0
    for n in sorted(lens):
        nb = -(-n // block)
        seqs.append((perm[p:p + nb], n - 1, 1))
        p += nb
    meta = build_metadata(seqs, block, window, "cpu")
    t = len(lens)
    q = torch.randn(t, h + kvh, dim, generator=g)[:, :h]          # a strided view, as the model passes it
    k, v = torch.randn(t, kvh, dim, generator=g), torch.randn(t, kvh, dim, generator=g)
    return q, k, v, kc, vc, meta


# Decodes only (a context of 1 is a prefill). The small step runs on the calling thread, the large
# one (32 x 130 x 9 position-heads) across the pool.
SMALL = [2, 3, 15, 16, 17, 33, 200, 251, 64, 100]
LARGE = [130] * 24 + [5, 70, 300, 301, 16, 17, 32, 33]


@needs_kernel
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("lens", [SMALL, LARGE], ids=["small", "large"])
def test_kernel_matches_torch(window, heads, lens):
    q, k, v, kc, vc, meta = _case(lens, window, heads)
    assert len(meta.decode_groups) > 1
    want = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    got = paged_attention(q, k, v, kc, vc, meta, 0.125, kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 40, 128])
def test_outputs_do_not_depend_on_how_heads_are_split_into_tasks(dim):
    """A task covers one KV head of a sequence or all of them (pd_attend_heads: all once there are
    4 sequences a thread); either way, and on any number of threads, the same bits."""
    q, k, v, kc, vc, meta = _case(LARGE, None, dim=dim)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 16):       # 32 sequences: whole sequences up to 8 threads, heads at 16
            torch.set_num_threads(threads)
            outs.append(paged_attention(q, k, v, kc.clone(), vc.clone(), meta, dim ** -0.5, kernel))
    finally:
        torch.set_num_threads(before)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@needs_kernel
@pytest.mark.parametrize("dim", [36, 40, 128])    # scalar loops, 8-wide without the 64 path, 8-wide
def test_kernel_matches_torch_at_other_head_dims(dim):
    q, k, v, kc, vc, meta = _case(LARGE, None, dim=dim)
    want = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, dim ** -0.5)
    got = paged_attention(q, k, v, kc, vc, meta, dim ** -0.5, kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_softmax_over_wide_score_ranges():
    """Scores spread over hundreds (the kernel's own exp, its underflow clamp) still match torch's."""
    q, k, v, kc, vc, meta = _case(LARGE, None)
    want = paged_attention(q * 40, k, v, kc.clone(), vc.clone(), meta, 0.125)
    got = paged_attention(q * 40, k, v, kc, vc, meta, 0.125, kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bounds_read_off_the_mask():
    lens = [3, 40, 41, 90]
    meta = _case(lens, 32)[-1]
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
    assert [p.name for p in first.parent.iterdir()] == [first.name]     # no temporary left behind


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math would set flush-to-zero for the whole process as it loads."""
    assert native.load("decode_attention") is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float((tiny * 1.0)[0]) != 0.0 and 1e-310 * 1.0 != 0.0
