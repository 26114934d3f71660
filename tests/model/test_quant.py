"""Weight-only quantization: the schemes, the GGUF Q4 blocks loaded as stored, the kernels against the
dequantized product, and the default model quantized against float32 (agreement, KL, weight bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from float_bounds import assert_within, gamma, matmul_bound

from pdserve.bench.quality import agreement_and_kl, sequence_logits
from pdserve.config import ModelConfig
from pdserve.model.kernels import qgemm
from pdserve.model.linear import linear
from pdserve.model.loader import build_model, default_gguf_path
from pdserve.model.quant import GROUP, QuantizedWeight, Staged, cat_rows, from_gguf_blocks, pack, quantize
from pdserve.utils.cpu import cpu_flags


@pytest.mark.parametrize("mode,tol", [("int8", 1 / 254), ("int4", 1 / 30)])
def test_quantize_roundtrip_error_is_within_half_a_step(mode, tol):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    st = quantize(w, mode)
    err = (st.dequantize() - w).abs()
    # Half a quantization step: |w|max/127/2 per row (int8), (max-min)/15/2 per group (int4), where
    # int4's float16 scale may round up by one part in 2^11 (never down: the levels span the group).
    span = (
        w.abs().amax(1, keepdim=True) * 2
        if mode == "int8"
        else (w.view(64, -1, GROUP).amax(-1) - w.view(64, -1, GROUP).amin(-1)).repeat_interleave(GROUP, 1)
    )
    slack = 1 + (2**-10 if mode == "int4" else 0)
    assert (err <= span * tol * slack + 1e-6).all()
    if mode == "int4":  # float16 scale and offset, as GGUF stores them
        assert torch.equal(st.scale.half().float(), st.scale) and torch.equal(st.zero.half().float(), st.zero)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_in_row_chunks_is_quantizing_whole(monkeypatch, mode):
    """A large matrix is quantized some rows at a time (bounded scratch), from any float dtype: the
    same values as the whole float32 matrix at once (rows are independent)."""
    from pdserve.model import quant

    w = torch.randn(100, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = quantize(w.float(), mode)
    monkeypatch.setattr(quant, "_QUANT_CHUNK", 64 * 7)  # 7 rows a pass, the last pass partial
    chunked = quantize(w, mode)
    for name in ("q", "scale", "zero"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def test_gguf_q4_blocks_load_exactly():
    import gguf

    from pdserve.common.gguf_file import GGUFFile  # read as gguf-py reads it: test_gguf_file.py

    t = next(t for t in GGUFFile(default_gguf_path()).tensors() if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    st = from_gguf_blocks(t.data, "Q4_1")
    assert st.q.dtype == torch.uint8 and int(st.q.max()) <= 15
    assert torch.equal(st.dequantize(), want)  # int4 + scale + offset holds Q4_1 exactly
    # Q4_0 is the case offset = -8 * scale: rebuild the same rows as Q4_0 blocks and read them back.
    d = st.scale.half()
    q = st.q.view(st.q.shape[0], -1, GROUP)
    blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)], -1)
    q40 = from_gguf_blocks(blocks.reshape(st.q.shape[0], -1).numpy(), "Q4_0")
    assert torch.equal(q40.dequantize(), (q.float() - 8).mul(d.float()[..., None]).view_as(want))


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize(
    "rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 100, 300]
)  # 1-8: registers with AVX-512 (1-4 else); then tiles; 300: large
def test_kernel_matches_dequantized_product(mode, rows, native):
    if native and not qgemm.available():
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 576, generator=g)  # 576: two full 256-value blocks and a partial one
    st = quantize(w, mode)
    qw = QuantizedWeight(st, native=native)
    assert qw.native == native
    x = torch.randn(rows, 576, generator=g)
    want = (x.double() @ st.dequantize().double().t()).float()
    got = linear(x, qw)
    assert got.shape == want.shape and got.dtype == torch.float32
    # torch's kernels round activations to bfloat16: relative error ~ 2^-8 of the row's scale; so
    # does the native kernel from qgemm.bf16_rows() rows on (a prefill, on an AVX512-BF16 CPU);
    # below that it keeps float32 (only the order of the sums differs).
    bf16 = native and 0 < qgemm.bf16_rows(mode) <= rows
    err = (got - want).abs().max() / want.abs().max()
    assert err <= (1e-5 if native and not bf16 else 0.02)
    if bf16:
        assert err > 1e-5  # the bfloat16 path ran
    assert qw.nbytes < w.numel() * 4 / (3.5 if mode == "int8" else 5)
    torch.testing.assert_close(qw.dequantize(), st.dequantize(), rtol=1e-6, atol=1e-6)
    if mode == "int8":  # the tied embedding's lookup: q * scale, one rounding, as dequantize's rows
        ids = torch.tensor([0, 17, 95, 17])
        assert torch.equal(qw.rows(ids, torch.float32), st.q[ids].float() * st.scale[ids, None].float())
        torch.testing.assert_close(qw.rows(ids, torch.float32), st.dequantize()[ids], rtol=1e-6, atol=1e-6)
        with pytest.raises(IndexError):
            qw.rows(torch.tensor([0, w.shape[0]]), torch.float32)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tiles_side_by_side_give_each_tiles_own_bits(mode):
    """On the bfloat16 pairs (int8's, int4's rounded tile) a thread runs up to four tiles at once: each
    tile's outputs are the bits it gives alone (a product of that tile's 16 channels), at every row
    count, with one thread and two (which hand the tiles out differently)."""
    if not qgemm.available() or qgemm.bf16_rows(mode) == 0:
        pytest.skip("no bfloat16 products here")
    if "amx_tile" in cpu_flags() and qgemm.amx():
        pytest.skip("AMX's tiles take these products here")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16 * 11, 512, generator=g)  # 11 tiles: groups of 4, 4 and 3, or the threads' shares
    full = QuantizedWeight(quantize(w, mode), native=True)
    alone = [QuantizedWeight(quantize(w[i : i + 16], mode), native=True) for i in range(0, len(w), 16)]
    threads, rounded = torch.get_num_threads(), qgemm.pairs_rounded_start()
    qgemm.pairs_rounded_from(9)  # int4: the rounded tile from the pairs' first row count
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (9, 13, 40):
                x = torch.randn(rows, 512, generator=g)
                assert torch.equal(linear(x, full), torch.cat([linear(x, a) for a in alone], 1)), (t, rows)
    finally:
        torch.set_num_threads(threads)
        qgemm.pairs_rounded_from(rounded)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_products_bits_do_not_depend_on_how_far_ahead_it_prefetches(mode):
    """qgemm.prefetch moves only loads asked for early (the register rows of 1-8 rows, int8's split over
    several accumulators): the same bits at every distance, on one thread and on two."""
    if not qgemm.available():
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(3)
    qw = QuantizedWeight(quantize(torch.randn(256, 2048, generator=g), mode), native=True)
    x = torch.randn(8, 2048, generator=g)
    threads, before = torch.get_num_threads(), qgemm.prefetch_bytes()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs = []
            for nbytes in (512, 2048, 8192, 32768):
                qgemm.prefetch(nbytes)
                assert qgemm.prefetch_bytes() == nbytes
                outs.append([linear(x[:r], qw) for r in (1, 2, 3, 8)])
            for other in outs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))
        qgemm.prefetch(1 << 20)
        assert qgemm.prefetch_bytes() == 32768  # clamped
    finally:
        torch.set_num_threads(threads)
        qgemm.prefetch(before)


@pytest.mark.parametrize("rows", [24, 40])  # float32 activations; bfloat16 from qgemm.bf16_rows("int4") on
def test_native_kernel_reads_strided_rows_and_keeps_threads_apart(rows):
    """A view with a row stride (a slice of a wider activation) and one thread or two give the same."""
    if not qgemm.available():
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(3)
    st = quantize(torch.randn(64, 256, generator=g), "int4")
    qw = QuantizedWeight(st, native=True)
    wide = torch.randn(rows, 300, generator=g)
    x = wide[:, 10:266]
    assert not x.is_contiguous()
    want = linear(x.contiguous(), qw)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, qw)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, want, rtol=0, atol=0)
    ref = x.double() @ st.dequantize().double().t()
    if 0 < qgemm.bf16_rows("int4") <= rows:
        assert (want - ref).abs().max() <= 0.02 * ref.abs().max()
    else:
        # The kernel sums scale * (x . q) + zero * sum(x) group by group: bound each part's magnitude.
        n, k = st.q.shape
        parts = (st.q.view(n, k // GROUP, GROUP).double() * st.scale[..., None].double()).abs()
        parts = (parts + st.zero[..., None].double().abs()).view(n, k)
        assert_within(want, ref, gamma(k + 4) * (x.double().abs() @ parts.t()), "int4 product")


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_amx_tiles_agree_with_the_vector_path_and_keep_each_rows_result(mode):
    """Where the CPU has Intel AMX: the tile products (from bf16_rows, all rows including a last
    block of fewer than 16) are within bfloat16's rounding of a float64 reference, as the
    AVX512-BF16 path is, and a row's result does not depend on how many rows share the product."""
    if not qgemm.available() or not qgemm.amx():
        pytest.skip("no AMX tiles here (the CPU, the build or the kernel's permission)")
    g = torch.Generator().manual_seed(5)
    st = quantize(torch.randn(64, 576, generator=g), mode)
    qw = QuantizedWeight(st, native=True)
    rows = 53  # three blocks of 16 rows and one of 5
    assert 0 < qgemm.amx_rows(mode) < rows - 16
    x = torch.randn(rows, 576, generator=g)
    w = st.dequantize()
    ref = x.double() @ w.double().t()
    # The activations rounded to bfloat16 (and int4's dequantized weight: the rounded tile), then
    # float32 sums of exact products in any order.
    u = 2.0**-8 * (2 if mode == "int4" else 1)
    bound = (u + gamma(576 + 2)) * (x.double().abs() @ w.double().abs().t())
    try:
        on = linear(x, qw)
        assert qgemm.amx(False) is False
        off = linear(x, qw)
    finally:
        qgemm.amx(True)
    assert_within(on, ref, bound, f"{mode} on AMX")
    assert_within(off, ref, bound, f"{mode} on AVX512-BF16")
    assert not torch.equal(on, off)  # the tiles ran: their sums go in another order
    # Below 48 rows the blocks run in one pass over K (the next tile's pairs laid out meanwhile): each
    # row keeps its bits there too, with and without a last block of fewer than 16.
    once = [m for m in (47, 33, 32, 17, 16) if m >= qgemm.amx_rows(mode)]
    for m in (rows - 1, rows - 16, qgemm.amx_rows(mode) + 1, *once):
        torch.testing.assert_close(linear(x[:m], qw), on[:m], rtol=0, atol=0)
    if mode == "int8":  # its tiles can start from 1 row (kernels/tuning.py measures where)
        start = qgemm.amx_rows("int8")
        try:
            qgemm.amx8_from(1)
            assert qgemm.bf16_rows("int8") == 1
            for m in (1, 2, 3, 5, 8):
                torch.testing.assert_close(linear(x[:m], qw), on[:m], rtol=0, atol=0)
            qgemm.amx8_from(9)
            assert not torch.equal(linear(x[:5], qw), on[:5])  # the float32 kernel
        finally:
            qgemm.amx8_from(start)


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_prefill_blocks_keep_each_rows_result_across_chunks_of_tiles(mode, threads):
    """From 48 rows the tiles run by chunks of output tiles (their pairs laid out a chunk at a time)
    and blocks of 16 rows, one or two tiles a block: with K = 4,096 a chunk holds 4 tiles, so 10
    tiles take three chunks on one thread and two on each of two (the second of one tile). Every row
    keeps the bits it has in any other product of 48 rows or more, a last block of fewer than 16 rows
    included, and the result is within bfloat16's rounding of a float64 reference."""
    if not qgemm.available() or not qgemm.amx():
        pytest.skip("no AMX tiles here (the CPU, the build or the kernel's permission)")
    g = torch.Generator().manual_seed(11)
    k = 4096
    st = quantize(torch.randn(160, k, generator=g), mode)
    qw = QuantizedWeight(st, native=True)
    x = torch.randn(100, k, generator=g)
    w = st.dequantize().double()
    saved, depth = torch.get_num_threads(), qgemm.amx_tile_pairs_start()
    qgemm.amx_tile_pairs_from(1 << 20)  # one tile a block first (a model load may have measured a depth)
    torch.set_num_threads(threads)
    try:
        tall = linear(x, qw)
        for lo, hi in ((0, 53), (7, 55), (30, 100)):
            torch.testing.assert_close(linear(x[lo:hi], qw), tall[lo:hi], rtol=0, atol=0)
        # Two output tiles a block (from a measured depth): the same sums, an odd tile left alone.
        qgemm.amx_tile_pairs_from(32)
        torch.testing.assert_close(linear(x, qw), tall, rtol=0, atol=0)
        torch.testing.assert_close(linear(x[7:55], qw), tall[7:55], rtol=0, atol=0)
    finally:
        qgemm.amx_tile_pairs_from(depth)
        torch.set_num_threads(saved)
    u = 2.0**-8 * (2 if mode == "int4" else 1)
    bound = (u + gamma(k + 2)) * (x.double().abs() @ w.abs().t())
    assert_within(tall, x.double() @ w.t(), bound, f"{mode} on AMX by chunks and blocks")


@pytest.mark.parametrize("k", [576, 544])
def test_amx_exact_tiles_round_only_the_activations_and_keep_each_rows_result(k):
    """Where the CPU has Intel AMX: int4 products of few rows on the exact tiles (the nibbles exact,
    each group's scale and offset in float32) are within the activations' bfloat16 rounding of a
    float64 reference, at every row count from 1 to 16 a row's result is the same bits, and below
    the measured start the float32 kernel runs (float32 rounding only). Five output tiles (the
    kernel takes two at a time) and an even and an odd number of groups (its pipeline's parity)."""
    if not qgemm.available() or not qgemm.amx():
        pytest.skip("no AMX tiles here (the CPU, the build or the kernel's permission)")
    g = torch.Generator().manual_seed(6)
    st = quantize(torch.randn(80, k, generator=g), "int4")
    qw = QuantizedWeight(st, native=True)
    x = torch.randn(16, k, generator=g)
    n, k = st.q.shape
    parts = (st.q.view(n, k // GROUP, GROUP).double() * st.scale[..., None].double()).abs()
    parts = (parts + st.zero[..., None].double().abs()).view(n, k)
    scale = x.double().abs() @ parts.t()
    ref = x.double() @ st.dequantize().double().t()
    saved = qgemm.bf16_rows("int4"), qgemm.amx_rows("int4"), qgemm.amx_rows("int8")
    try:
        qgemm.amx_exact_from(1)
        qgemm.amx_from(32)  # the machine's measured start may be 16 rows or fewer: past them here
        assert qgemm.bf16_rows("int4") == 1
        on = linear(x, qw)
        assert_within(on, ref, (2.0**-8 + gamma(k + 4)) * scale, "int4 on the exact tiles")
        for m in (1, 2, 3, 5, 8, 13, 15):
            torch.testing.assert_close(linear(x[:m], qw), on[:m], rtol=0, atol=0)
        torch.testing.assert_close(linear(x[7:8], qw), on[7:8], rtol=0, atol=0)
        assert qgemm.amx(False) is False  # the same operands on vdpbf16ps: the sums' order differs
        pairs = linear(x, qw)
        qgemm.amx(True)
        assert_within(pairs, ref, (2.0**-8 + gamma(k + 4)) * scale, "int4 on AVX512-BF16 pairs")
        assert not torch.equal(on, pairs)
        # Past 16 rows in blocks of 16 (the last padded), with model.batch_invariant's bound past
        # the rounded tile's start (qgemm.invariant_rows): a row's bits are still its own.
        more = torch.randn(40, k, generator=g)
        qgemm.invariant_rows(64)
        assert qgemm.bf16_rows("int4") == 1 and qgemm.amx_rows("int4") == 32
        tall = linear(more, qw)
        for m in (1, 16, 17, 33):
            torch.testing.assert_close(linear(more[:m], qw), tall[:m], rtol=0, atol=0)
        ref_more = more.double() @ st.dequantize().double().t()
        bound = (2.0**-8 + gamma(k + 4)) * (more.double().abs() @ parts.t())
        assert_within(tall, ref_more, bound, "int4 on the exact tiles, 40 rows")
        # int8 on the tiles from 1 row too (its exact pairs): each row's bits its own.
        assert qgemm.bf16_rows("int8") == 1
        q8 = QuantizedWeight(quantize(torch.randn(80, k, generator=g), "int8"), native=True)
        tall8 = linear(more, q8)
        for m in (1, 5, 9, 17):
            torch.testing.assert_close(linear(more[:m], q8), tall8[:m], rtol=0, atol=0)
        qgemm.invariant_rows(0)
        qgemm.amx8_from(9)  # unmeasured: up to 8 rows in the float32 kernel
        assert not torch.equal(linear(more[:5], q8), tall8[:5])
        qgemm.amx_from(32)
        qgemm.amx_exact_from(9)  # unmeasured: up to 8 rows in the float32 kernel
        assert qgemm.bf16_rows("int4") == 9
        assert_within(linear(x[:8], qw), ref[:8], gamma(k + 4) * scale[:8], "int4 in float32")
    finally:
        qgemm.amx(True)
        qgemm.invariant_rows(0)
        qgemm.amx_exact_from(saved[0])
        qgemm.amx_from(saved[1])
        qgemm.amx8_from(saved[2])


def test_fused_rows_keep_their_groups_and_odd_shapes_stay_float():
    g = torch.Generator().manual_seed(2)
    a, b = (
        quantize(torch.randn(16, 64, generator=g), "int4"),
        quantize(torch.randn(32, 64, generator=g), "int4"),
    )
    fused = cat_rows([a, b], "int4")
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    odd = torch.randn(12, 48, generator=g)  # int4 packs rows in tiles of 16 and groups of 32
    assert isinstance(pack(odd, "int4", torch.float32, "cpu"), torch.Tensor)
    assert isinstance(pack(Staged("int8", *_int8(odd)), "int8", torch.float32, "cpu"), QuantizedWeight)


def _int8(w):
    st = quantize(w, "int8")
    return st.q, st.scale


@pytest.mark.slow
def test_default_model_int4_and_int8_against_float32(smollm_files):
    from pdserve.model.loader import load_model_files

    ref = build_model(smollm_files, "float32")
    tok = smollm_files.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    ids = ids + tok.encode(
        " The sky looks blue because sunlight is scattered by the air, and blue light"
        " scatters much more than red light does."
    )
    want = sequence_logits(ref, ids)
    fbytes = ref.weight_bytes()
    del ref
    for mode, min_agree, max_kl in (("int4", 0.9, 0.1), ("int8", 0.9, 0.1)):
        loaded = load_model_files("smollm2-135m", quantization=mode)
        if mode == "int4":  # the file's Q4_1 tensors arrive as stored, no float copy
            assert isinstance(loaded.weights["model.layers.0.mlp.down_proj.weight"], Staged)
        model = build_model(loaded, "float32", model_config=ModelConfig(quantization=mode))
        agree, kl = agreement_and_kl(want, sequence_logits(model, ids))
        assert agree >= min_agree and kl <= max_kl, (mode, agree, kl)
        assert model.weight_bytes() < fbytes * (0.3 if mode == "int8" else 0.2)


def test_float32_weight_in_the_native_layout():
    """A float32 weight packed for the native kernel: products and embedding rows as the plain tensor's."""
    if not qgemm.available():
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 320, generator=g)
    t = pack(w, "none", torch.float32, "cpu", native=True)
    assert isinstance(t, qgemm.TiledFloat) and torch.equal(t.dequantize(), w)
    for rows in (1, 2, 9, 70):
        x = torch.randn(rows, 320, generator=g)
        assert_within(linear(x, t), x.double() @ w.double().t(), matmul_bound(x, w), f"{rows} rows")
    ids = torch.tensor([47, 0, 16, 16])
    assert torch.equal(t.rows(ids, torch.float32), w[ids])
    # Not for other dtypes or shapes the tiles cannot hold: those stay plain tensors.
    assert isinstance(pack(w, "none", torch.bfloat16, "cpu", native=True), torch.Tensor)
    assert isinstance(pack(torch.randn(12, 64), "none", torch.float32, "cpu", native=True), torch.Tensor)
