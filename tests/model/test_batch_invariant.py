"""model.batch_invariant (qgemm.invariant_rows): int4 and int8 products of up to its rows give each row
the same bits whatever the row count, on this CPU's build and on every other vector build this CPU
can run (AVX2 without bfloat16, AVX-512 without it, AVX512-BF16), within a rounding bound of a
float64 reference; without it the row-count paths differ (what the setting exists to avoid)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from float_bounds import assert_within, gamma
from kernel_builds import AVX2, AVX2_NEEDS, runnable_qgemm, unmeasured_paths

from pdserve.model.kernels import qgemm
from pdserve.model.linear import linear
from pdserve.model.quant import GROUP, QuantizedWeight, quantize

needs_kernel = pytest.mark.skipif(not qgemm.available(), reason="no C compiler here")
N, K = 48, 576  # 18 groups of 32: past the kernel's buffered block of 256 input values
ROWS = 40
# Every path's row counts: the register rows (1-2 and 3-8), the bfloat16 rows' starts (9, 32), AMX's
# blocks of 16 and a last block of fewer.
COUNTS = (1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 31, 32, 33, 39)
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl"]
# Builds of qgemm by vector flags: (name, flags, the CPU features it needs to run).
VARIANTS = [
    ("portable", [], []),
    ("avx2", AVX2, AVX2_NEEDS),
    ("avx512", AVX512, [*AVX2_NEEDS, "avx512f", "avx512bw", "avx512vl"]),
    (
        "avx512-bf16",
        [*AVX512, "-mavx512bf16"],
        [*AVX2_NEEDS, "avx512f", "avx512bw", "avx512vl", "avx512_bf16"],
    ),
]


def _weights(seed: int) -> dict[str, tuple[QuantizedWeight, torch.Tensor]]:
    """Per mode: the native weight and the magnitudes of the parts its kernels sum, a value each:
    |q d| + |m| (int4: a group's scale and offset apply after its sums) or |q d| (int8)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for mode in ("int4", "int8"):
        st = quantize(torch.randn(N, K, generator=g) * 0.05, mode)
        if mode == "int4":
            parts = st.q.view(N, K // GROUP, GROUP).double() * st.scale[..., None].double()
            parts = (parts.abs() + st.zero[..., None].double().abs()).view(N, K)
        else:
            parts = st.dequantize().double().abs()
        out[mode] = (QuantizedWeight(st, native=True), parts)
    return out


def _rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, K, generator=g) * torch.logspace(-1, 1, ROWS)[:, None]


def _check(got: torch.Tensor, qw: QuantizedWeight, parts: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """Within the activations' bfloat16 rounding (the exact pairs and tiles; the float32 kernels round
    less) and float32 sums over K plus the scales' steps, of a float64 reference."""
    ref = x.double() @ qw.dequantize().double().t()
    assert_within(got, ref, (2.0**-8 + gamma(K + 4)) * (x.double().abs() @ parts.t()), what)


@needs_kernel
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_each_rows_bits_are_its_own_at_every_row_count(mode):
    (qw, parts), x = _weights(0)[mode], _rows(1)
    try:
        qgemm.invariant_rows(64)
        assert qgemm.bf16_rows(mode) in (0, 1)  # rounding (where built in) from 1 row
        tall = linear(x, qw)
        _check(tall, qw, parts, x, f"{mode}, invariant")
        for m in COUNTS:
            assert torch.equal(linear(x[:m], qw), tall[:m]), (mode, m)
        assert torch.equal(linear(x[7:8], qw), tall[7:8])
        qgemm.invariant_rows(0)
        with unmeasured_paths():
            plain = {m: linear(x[:m], qw) for m in COUNTS}
            plain_tall = linear(x, qw)
    finally:
        qgemm.invariant_rows(0)
    # Without it the row counts take paths that sum in other orders: some row differs (on the kernel's
    # own starts, which COUNTS straddle; a machine's tuning may start a path at 1 row).
    assert any(not torch.equal(plain[m], plain_tall[:m]) for m in COUNTS)


@needs_kernel
@pytest.mark.skipif(
    not qgemm.amx_vectors_agree(), reason="no AMX tiles here, or their bits are not the vectors' on this CPU"
)
@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("k", [K, 96, 1536])  # 18 groups (4 at a time, 2 left), 3, 48
def test_the_vectors_compute_the_tiles_bits(mode, k):
    """AMX's tiles copied on vector FMAs (qgemm.amx_vectors4_below, amx_vectors8_below): every row count
    the vectors take gives the tiles' bits, so with them taking the few rows a row is still its own at
    every count (model.batch_invariant)."""
    g = torch.Generator().manual_seed(4)
    qw = QuantizedWeight(quantize(torch.randn(N, k, generator=g) * 0.05, mode), native=True)
    x = torch.randn(ROWS, k, generator=g) * torch.logspace(-1, 1, ROWS)[:, None]
    below = qgemm.amx_vectors4_below if mode == "int4" else qgemm.amx_vectors8_below
    saved = qgemm.paths()
    try:
        qgemm.invariant_rows(64)
        below(1)  # the tiles at every count
        tiles = {m: linear(x[:m], qw) for m in range(1, 10)}
        tall = linear(x, qw)
        below(9)  # the vectors at 1-8 rows
        for m in range(1, 10):
            assert torch.equal(linear(x[:m], qw), tiles[m]), (mode, k, m)
            assert torch.equal(tiles[m], tall[:m]), (mode, k, m)
        assert torch.equal(linear(x[5:6], qw), tall[5:6])
    finally:
        qgemm.set_paths(saved)


@needs_kernel
@pytest.mark.parametrize("name,flags,needs", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_every_vector_build_keeps_each_rows_bits(tmp_path, name, flags, needs):
    """The builds this CPU can run, each on its own paths (the register rows and the dequantized block
    without bfloat16; the exact pairs with it): with the bound set, a row's bits are the same at every
    row count up to it, and within the rounding bound of the float64 reference."""
    lib, fn = runnable_qgemm(tmp_path, name, flags, needs)
    lib.pd_qgemm_invariant.restype = ctypes.c_int
    lib.pd_qgemm_invariant.argtypes = [ctypes.c_int]
    x = _rows(2)

    def product(qw: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
        bits, t, d, m = qw.operands()
        rows = rows.contiguous()
        y = torch.empty(rows.shape[0], N)
        fn(
            bits,
            t.data_ptr(),
            d.data_ptr(),
            m.data_ptr(),
            rows.data_ptr(),
            K,
            y.data_ptr(),
            N,
            rows.shape[0],
            N,
            K,
            2,
        )
        return y

    assert lib.pd_qgemm_invariant(64) == 64
    for mode, (qw, parts) in _weights(3).items():
        tall = product(qw, x)
        _check(tall, qw, parts, x, f"{name} {mode}")
        for m in COUNTS:
            assert torch.equal(product(qw, x[:m]), tall[:m]), (name, mode, m)
