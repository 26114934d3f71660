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

from pdserve.model.kernels import native, qgemm
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
    # int8 weights have no integer kernel: their activations stay float32 in this mode.
    w8 = QuantizedWeight(quantize(torch.randn(32, 64), "int8"), "cpu", native=True, activations="int8")
    assert w8.operands()[0] == 8


@needs_kernel
def test_portable_build_matches_this_cpus_build(tmp_path):
    """The portable C variant (no vector flags) against the one this CPU runs: the same integers and the
    same float steps in the same order, so the same bits."""
    cc = native._compiler()
    srcs = [str(native.HERE / f"{n}.c") for n in ("qgemm", "qgemm_bf16", "qgemm_q8")]
    out = tmp_path / "portable.so"
    proc = subprocess.run(
        [cc, *native.CFLAGS, *srcs, "-o", str(out), "-lm"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"the portable build failed here: {proc.stderr[-400:]}")
    lib = ctypes.CDLL(str(out))
    lib.pd_qgemm_q8_variant.restype = ctypes.c_int
    assert lib.pd_qgemm_q8_variant() == 0
    fn = lib.pd_qgemm
    fn.restype = None
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [i, p, p, p, p, i64, p, i64, i, i, i, i]
    w = _weight()
    bits, t, d, m = w.operands()
    for rows in (1, 3, 9):
        x = _rows(rows, seed=rows)
        y = torch.empty(rows, N)
        fn(bits, t.data_ptr(), d.data_ptr(), m.data_ptr(), x.data_ptr(), K, y.data_ptr(), N, rows, N, K, 1)
        assert torch.equal(y, _product(w, x)), rows
