"""Quantized weight x float32 activations through qgemm.c: the weight's tile layout (built once at
load) and the call. See the C file for the layouts and why it beats torch's weight-only kernels here."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from functools import lru_cache

import torch

from pdserve.model.kernels.native import function, load, ptr

_I, _I64, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
TILE = 16  # output channels per tile (NC in the C file)
# A flag on int4's or int8's bits (PD_AQ8 in qgemm.h): every product of that weight quantizes its
# activations to int8 per row in blocks of 32 and multiplies in integers (qgemm_q8.c).
AQ8 = 256


@lru_cache(maxsize=1)
def _fn():
    return function("qgemm", "pd_qgemm", [_I, _P, _P, _P, _P, _I64, _P, _I64, _I, _I, _I, _I])


def available() -> bool:
    """Whether the kernel builds and loads here (else the torch path runs, logged once)."""
    return _fn() is not None


def bf16_rows(mode: str) -> int:
    """From how many rows products of an "int4" or "int8" weight round their activations to bfloat16
    (AVX512-BF16 CPUs: the pairs, or AMX's tiles where granted; see qgemm_bf16.c); 0 where they never
    do."""
    fn = function("qgemm", "pd_qgemm_bf16_rows", [_I])
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    return int(fn({"int4": 4, "int8": 8}[mode]))


def _in_every_library(symbol: str) -> list:
    """`symbol` (int f(int)) of every library that links qgemm_bf16.c: each has its own copy of the
    kernel's state (the fused decode layers, the MoE kernel), so each is told the same."""
    fns = [function(lib, symbol, [_I]) for lib in ("qgemm", "layer", "moe")]
    for fn in fns:
        if fn is not None:
            fn.restype = ctypes.c_int
    return [fn for fn in fns if fn is not None]


def _setting(symbol: str) -> int:
    """What a setter of the kernel (int f(int), below 0: only returns its value) holds now; 0 where the
    kernel does not load here."""
    fn = function("qgemm", symbol, [_I])
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    return int(fn(-1))


def _set_everywhere(symbol: str, rows: int) -> None:
    for fn in _in_every_library(symbol):
        fn(rows)


def amx(want: bool = True) -> bool:
    """Whether the bfloat16 products (bf16_rows) take Intel AMX's tiles: asked for (granted by the
    kernel where the CPU has them and the build has them), or turned off with want=False, where the
    AVX512-BF16 paths run (the same operands; sums in another order)."""
    got = [bool(fn(1 if want else 0)) for fn in _in_every_library("pd_qgemm_amx")]
    return bool(got) and all(got)


def amx_from(rows: int) -> None:
    """From how many rows int4 products take the rounded tile (kernels/tuning.py measures it); clamped
    to [9, 32]."""
    _set_everywhere("pd_qgemm_amx_from", rows)


def amx_exact_from(rows: int) -> None:
    """From how many rows int4 products below the rounded tile take AMX's exact tiles instead of the
    float32 kernel (kernels/tuning.py measures it); clamped to [1, 9], 9 until measured."""
    _set_everywhere("pd_qgemm_amx_exact_from", rows)


def amx8_from(rows: int) -> None:
    """From how many rows int8 products take AMX's tiles instead of the float32 kernel
    (kernels/tuning.py measures it); clamped to [1, 9], 9 until measured."""
    _set_everywhere("pd_qgemm_amx8_from", rows)


def amx_vectors4_below(rows: int) -> None:
    """Below how many rows int4 products that would take AMX's exact tiles compute the tiles' bits on
    vector FMAs instead (kernels/tuning.py measures it; the same bits, so processes need not agree on
    it); clamped to [1, 9], 1 (the tiles at every count) until measured. Only where
    amx_vectors_agree()."""
    _set_everywhere("pd_qgemm_amx_vectors4_below", rows)


def amx_vectors8_below(rows: int) -> None:
    """amx_vectors4_below for int8 products on AMX's tiles."""
    _set_everywhere("pd_qgemm_amx_vectors8_below", rows)


def amx_vectors_agree() -> bool:
    """Whether vector FMAs give this CPU's AMX tiles' bits (checked once a process on a few products
    of random operands; False where no tiles run): only then do amx_vectors4_below and
    amx_vectors8_below take effect."""
    fn = function("qgemm", "pd_qgemm_amx_vectors_agree", [])
    if fn is None:
        return False
    fn.restype = ctypes.c_int
    return bool(fn())


def amx_tile_pairs_from(k: int) -> None:
    """From which depth K products of 48 rows or more on AMX's tiles take two output tiles per block
    of rows (the same sums; kernels/tuning.py measures it); 1 << 20 (never) until measured."""
    _set_everywhere("pd_qgemm_amx_pairs_from_k", k)


def amx_tile_pairs_start() -> int:
    """The depth amx_tile_pairs_from set (0 where the kernel does not load here)."""
    return _setting("pd_qgemm_amx_pairs_from_k")


def lut_from(rows: int) -> None:
    """From how many rows int4's float32 register rows (1-8 rows) look their nibbles up instead of
    converting them: the same floats, which is faster depends on the core (kernels/tuning.py measures
    it); 9 (never) until measured."""
    _set_everywhere("pd_qgemm_lut_from", rows)


def has_lut() -> bool:
    """Whether this build's int4 register rows have the lookup (the AVX-512 builds)."""
    return _setting("pd_qgemm_lut_from") > 0


def pairs_rounded_from(rows: int) -> None:
    """From how many rows int4 products take the rounded tile instead of the exact pairs, where AMX's
    tiles do not run (kernels/tuning.py measures it); clamped to [9, 64], 32 until measured."""
    _set_everywhere("pd_qgemm_pairs_rounded_from", rows)


def prefetch(nbytes: int) -> None:
    """How far ahead (bytes) products of a few rows with float activations prefetch their weight
    (qgemm.c's register rows); clamped to [512, 32768], 2048 unless set. Results do not depend on it."""
    _set_everywhere("pd_qgemm_prefetch", nbytes)


def prefetch_bytes() -> int:
    """The distance `prefetch` set (0 where the kernel does not load here)."""
    return _setting("pd_qgemm_prefetch")


def pairs_rounded_start() -> int:
    """From how many rows int4 products take the rounded tile on the vector pairs (pairs_rounded_from);
    0 where the kernel does not load here."""
    return _setting("pd_qgemm_pairs_rounded_from")


def invariant_rows(rows: int) -> None:
    """Every int4 and int8 product of up to `rows` rows (0: none, the default) on one arithmetic: its
    exact path from 1 row (AMX's exact tiles, else the AVX512-BF16 exact pairs, else, without
    bfloat16, the float32 kernel's dequantized block rather than its register rows); past `rows` (a
    prefill's products) the row-count paths. A row's result then does not depend on how many rows
    share its step, which speculative decoding needs: a verify step's rows must compute what a plain
    decode step computes for greedy output to stay token-identical. Clamped to [0, 4096]."""
    _set_everywhere("pd_qgemm_invariant", max(rows, 0))


def invariant_bound() -> int:
    """The rows invariant_rows set (0: none, or no kernel here)."""
    return _setting("pd_qgemm_invariant")


# The kernel's settings of its paths (each a setter int f(int) that reads below 0): the row counts and
# depth the tuning measures and model.batch_invariant's bound. A product's bits depend on each but the
# vectors' (their bits are the tiles'), carried along so that a process's paths are whole.
PATHS = (
    "lut_from",
    "amx_exact_from",
    "amx_from",
    "amx8_from",
    "amx_pairs_from_k",
    "pairs_rounded_from",
    "invariant",
    "amx_vectors4_below",
    "amx_vectors8_below",
)


def paths() -> dict[str, int]:
    """The paths this process's products take now, by PATHS' names ({} where the kernel does not load
    here). Processes whose products must give the same bits (an expert-parallel model's ranks) are
    set to rank 0's with set_paths: measured or cached apart, their choices could differ."""
    if not available():
        return {}
    return {name: _setting(f"pd_qgemm_{name}") for name in PATHS}


def set_paths(values: Mapping[str, int]) -> None:
    """Take another process's paths (from paths()); a build without a path ignores it."""
    unknown = set(values) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown kernel paths {sorted(unknown)}: allowed {list(PATHS)}")
    for name, value in values.items():
        _set_everywhere(f"pd_qgemm_{name}", int(value))


def amx_rows(mode: str) -> int:
    """From how many rows products of an "int4" or "int8" weight take AMX's tiles (0: they do not)."""
    fn = function("qgemm", "pd_qgemm_amx_rows", [_I])
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    return int(fn({"int4": 4, "int8": 8}[mode]))


@lru_cache(maxsize=1)
def q8_variant() -> str:
    """The int8-activation kernel this build runs: "vnni" (vpdpbusd), "avx2" (vpmaddubsw) or "c"."""
    lib = load("qgemm")
    if lib is None:
        return "none"
    return {0: "c", 1: "avx2", 2: "vnni"}[int(lib.pd_qgemm_q8_variant())]  # ctypes' default: an int


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations of x [M, K] float32: q int8 [M, K], and per block of 32 values the
    scale sx and sx * sum q [M, K/32] (x = q * sx within one rounding step a value)."""
    fn = function("qgemm", "pd_qgemm_q8_rows", [_P, _I64, _I, _I, _P, _P, _P])
    assert fn is not None and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] % 32 == 0
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    sx, ss = torch.empty(m, k // 32), torch.empty(m, k // 32)
    fn(ptr(x), k, m, k, ptr(q), ptr(sx), ptr(ss))
    return q, sx, ss


def tile_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q [N, K] in 0..15, scale and zero [N, K/32] -> nib [N/16, K/2, 16] uint8, d and m [N/16, K/32, 16]
    float16 (GGUF's own precision; quant.quantize rounds them so)."""
    n, k = q.shape
    t = q.to(torch.uint8).view(n // TILE, TILE, k).transpose(1, 2)  # [N/16, K, 16]
    nib = (t[:, 0::2] | (t[:, 1::2] << 4)).contiguous()

    def per_tile(s: torch.Tensor) -> torch.Tensor:
        return s.half().view(n // TILE, TILE, -1).transpose(1, 2).contiguous()

    return nib, per_tile(scale), per_tile(zero)


def untile_int4(nib: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float [N, K] matrix of a tiled int4 weight."""
    tiles, half, _ = nib.shape
    q = torch.stack([nib & 0x0F, nib >> 4], 2).view(tiles, half * 2, TILE).float()  # [N/16, K, 16]
    w = q.view(tiles, -1, 32, TILE) * d.float()[:, :, None] + m.float()[:, :, None]
    return w.view(tiles, half * 2, TILE).transpose(1, 2).reshape(tiles * TILE, half * 2)


def tile_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N] -> q [N/16, K, 16] int8, d [N/16, 16]."""
    n, k = q.shape
    return q.view(n // TILE, TILE, k).transpose(1, 2).contiguous(), scale.float().view(
        n // TILE, TILE
    ).contiguous()


@lru_cache(maxsize=1)
def _rows8():
    lib = load("qgemm")
    if lib is None:
        return None
    fn = lib.pd_qgemm_rows8
    fn.argtypes, fn.restype = [_P, _P, _P, _I, _I, _I, _P], ctypes.c_int
    return fn


def rows8(w: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an int8 weight tiled by tile_int8 (q [N/16, K, 16], d [N/16, 16]) as float32 [n, K]:
    q * d, as the dequantized matrix's rows. IndexError for an id that is not a row."""
    fn = _rows8()
    assert fn is not None and w.dtype == torch.int8 and d.dtype == torch.float32
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), w.shape[1], dtype=torch.float32)
    if fn(ptr(w), ptr(d), ptr(ids), ids.numel(), w.shape[0] * TILE, w.shape[1], ptr(out)):
        raise IndexError(f"row ids out of range for {w.shape[0] * TILE} rows")
    return out


def qgemm(
    bits: int, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, x: torch.Tensor, n: int
) -> torch.Tensor:
    """x [M, K] float32 @ the tiled weight's [N, K].T -> [M, N] float32."""
    fn = _fn()
    assert fn is not None and x.dtype == torch.float32 and x.dim() == 2
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    fn(
        bits,
        ptr(w),
        ptr(d),
        ptr(d if m is None else m),
        ptr(x),
        x.stride(0),
        ptr(y),
        n,
        x.shape[0],
        n,
        x.shape[1],
        torch.get_num_threads(),
    )
    return y


class TiledFloat:
    """A float32 [N, K] weight in the kernel's tile layout [N/16, K, 16]; `linear` calls `matmul`."""

    def __init__(self, w: torch.Tensor) -> None:
        n, k = w.shape
        self.shape = w.shape
        # One copy, converting as it lays out the tiles (a bfloat16 weight read from a file goes
        # straight to its float32 tiles).
        tiles = w.reshape(n // TILE, TILE, k).transpose(1, 2)
        self.tiles = torch.empty(tiles.shape, dtype=torch.float32, device=w.device).copy_(tiles)

    @staticmethod
    def fits(w: torch.Tensor) -> bool:
        return w.dim() == 2 and w.shape[0] % TILE == 0 and w.shape[1] % 32 == 0 and available()

    @property
    def nbytes(self) -> int:
        return self.tiles.numel() * 4

    resident_nbytes = nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.shape[0])
        return qgemm(32, self.tiles, self.tiles, None, x.float(), self.shape[0]).to(x.dtype)

    def operands(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bits, w, d, m) as qgemm.c takes them (d and m unused for float32)."""
        return 32, self.tiles, self.tiles, self.tiles

    def dequantize(self) -> torch.Tensor:
        """The [N, K] matrix."""
        return self.tiles.transpose(1, 2).reshape(self.shape)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the matrix: an embedding lookup."""
        return self.tiles[ids // TILE, :, ids % TILE].to(dtype)
