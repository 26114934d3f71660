"""Weight-only quantization of the linear layers: int8 (one scale per output channel) and int4
(groups of GROUP input values, each with a scale and an offset).

Schemes (documented in docs/models.md):
- int8: w[n, k] = q[n, k] * s[n], q in [-127, 127], s = max|w[n, :]| / 127 (symmetric per row, the
  format of `torch._weight_int8pack_mm`).
- int4: w[n, k] = q[n, k] * d[n, g] + m[n, g] over groups g of GROUP values along k, q in [0, 15]
  (asymmetric min/max; d and m float16). This is GGUF's Q4_1 exactly, so the default model's Q4_1
  tensors load as they are stored; Q4_0 (w = d * (q - 8)) is the case m = -8 d.

On CPU with float32 activations the products run through pdserve's own kernel (kernels/qgemm.c:
the weight dequantized a tile at a time in L1, float32 FMAs, activations not rounded) where it
builds: faster than torch's int4 kernel and MKL's float32 GEMM from 1 to 512 rows
(docs/benchmarks.md). Otherwise (`model.gemm_kernel: torch`, no compiler) PyTorch's weight-only kernels run; their
fast x86 paths take bfloat16 activations (float32 falls back to a scalar loop 10-100x slower), so
activations are rounded to bfloat16 for the product; at 32 rows they only tie float32 and at 512
rows they lose, so large products dequantize the weight and run the float32 GEMM. Elsewhere than
CPU the weight is dequantized for each product (correct everywhere; a device's own kernels are
future work).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.config_rules import QUANTIZATIONS
from pdserve.model.kernels import qgemm

GROUP = 32
# The config's concrete values (config_rules.py); `auto` is resolved to one of them before a model sees it.
MODES = tuple(m for m in QUANTIZATIONS if m != "auto")
# Above this many rows a product dequantizes and runs float32 (see the module docstring): the
# int4 kernel's time grows linearly with the rows, and dequantizing once for the float32 GEMM overtakes
# it near 100 rows (docs/benchmarks.md).
INT8_KERNEL_MAX_ROWS = 64
INT4_KERNEL_MAX_ROWS = 100


class Staged:
    """A quantized matrix still being assembled (rows fused, permuted) before it is packed for the
    kernel. int8: q int8 [N, K], scale [N]. int4: q uint8 [N, K] in 0..15, scale and zero [N, K/GROUP]."""

    def __init__(
        self, mode: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
    ) -> None:
        self.mode, self.q, self.scale, self.zero = (
            mode,
            q,
            scale.float(),
            None if zero is None else zero.float(),
        )

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        if self.mode == "int8":
            return self.q.float() * self.scale[:, None]
        n, k = self.q.shape
        q = self.q.view(n, k // GROUP, GROUP).float()
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)


# Elements quantized at a time (a 16 MB float32 scratch). Rows are independent (int8: a scale a row;
# int4: groups within a row), so the result is that of the whole matrix at once.
_QUANT_CHUNK = 1 << 22


def quantize(w: torch.Tensor, mode: str) -> Staged:
    """Quantize a float [N, K] matrix of any float dtype (the Hugging Face path: no file format to keep).
    Rows go a bounded number at a time through one float32 scratch buffer, every step in place: a large
    matrix (an output head) costs its quantized size and the scratch, no float32 copy and no temporaries
    (whose freed memory the heap may not reuse, and the resident set would keep)."""
    if mode not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {mode!r}; choose from {', '.join(MODES)}")
    n, k = w.shape
    if mode == "int4" and k % GROUP:
        raise ValueError(f"int4 needs rows of whole groups of {GROUP} values, not {k}")
    step = max(1, min(n, _QUANT_CHUNK // max(k, 1)))
    dev = w.device
    buf = torch.empty(step, k, device=dev)
    q = torch.empty(n, k, dtype=torch.int8 if mode == "int8" else torch.uint8, device=dev)
    scale = torch.empty(n, device=dev) if mode == "int8" else torch.empty(n, k // GROUP, device=dev)
    zero = None if mode == "int8" else torch.empty(n, k // GROUP, device=dev)
    for r in range(0, n, step):
        rows = min(step, n - r)
        x = buf[:rows]
        x.copy_(w[r : r + rows])
        if zero is None:
            # Symmetric per row: s = max|w| / 127 (max|w| as max(max w, -min w): no |w| copy).
            s = torch.maximum(x.amax(1), x.amin(1).neg_()).div_(127).clamp_min_(1e-12)
            x.div_(s[:, None]).round_().clamp_(-127, 127)
        else:
            g = x.view(rows, k // GROUP, GROUP)
            # Scale and offset in float16, as GGUF's Q4_1 stores them (the kernel reads a fifth fewer
            # bytes than with float32), rounded outwards so the 16 levels still span [min, max]: every
            # value stays within half a step.
            lo, hi = _f16_toward(g.amin(-1), -1), g.amax(-1)
            s = _f16_toward(((hi - lo) / 15).clamp_min(2**-14), 1)
            zero[r : r + rows] = lo
            g.sub_(lo[..., None]).div_(s[..., None]).round_().clamp_(0, 15)
        scale[r : r + rows] = s
        q[r : r + rows].copy_(x)
    return Staged(mode, q, scale, zero)


def _f16_toward(x: torch.Tensor, direction: int) -> torch.Tensor:
    """x rounded to float16, to the neighbour below (-1) or above (+1) where rounding went the other way."""
    h = x.half()
    off = h.float() < x if direction > 0 else h.float() > x
    step = torch.nextafter(h, torch.full_like(h, direction * float("inf")))
    return torch.where(off, step, h).float()


def can_quantize(w: torch.Tensor | Staged, mode: str) -> bool:
    """int4 needs whole groups along K, and the CPU packing output rows in tiles of 16."""
    if mode == "int4":
        return w.shape[1] % GROUP == 0 and w.shape[0] % 16 == 0
    return mode == "int8"


class QuantizedWeight:
    """A packed [N, K] weight; `linear(x, w)` calls `matmul`."""

    def __init__(
        self,
        staged: Staged,
        device: torch.device | str = "cpu",
        native: bool = False,
        activations: str = "none",
    ) -> None:
        """native: run pdserve's kernel (kernels/qgemm.py) for float32 activations on CPU. activations
        "int8": a native weight quantizes every product's activations to int8 per row in blocks of 32
        and multiplies in integers (kernels/qgemm_q8.c); otherwise they stay float32."""
        self.mode = staged.mode
        self.shape = staged.shape
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        self.native = native and self.on_cpu and staged.shape[0] % qgemm.TILE == 0 and qgemm.available()
        self.tiled: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
        self.int8_activations = activations == "int8" and self.native
        if self.native:
            if self.mode == "int8":
                self.tiled = (*qgemm.tile_int8(staged.q, staged.scale), None)
                self.scale = staged.scale.contiguous()  # the embedding lookup's rows
            else:
                self.tiled = qgemm.tile_int4(staged.q, staged.scale, staged.zero)
            self._read = [t for t in self.tiled if t is not None]
            self._tensors = self._read + ([self.scale] if self.mode == "int8" else [])
        elif self.mode == "int8":
            self.q = staged.q.to(self.device)
            self.scale = staged.scale.to(self.device)
            self.scale_bf16 = self.scale.to(torch.bfloat16)
            self._tensors = [self.q, self.scale, self.scale_bf16]
            self._read = [self.q, self.scale_bf16]
        elif self.on_cpu:
            # torch's (q - 8) * s + z convention: z = zero + 8 * scale.
            self.packed = torch._convert_weight_to_int4pack_for_cpu(staged.q.to(torch.int32), 2)
            sz = torch.stack([staged.scale, staged.zero + 8 * staged.scale], -1)  # [N, K/G, 2]
            self.scale_zero = sz.transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/G, N, 2]
            # Two values a byte, for dequantizing large (prefill) products: the kernel's packing is
            # opaque. Half a byte per weight more than the kernel's copy alone.
            self.nibbles = (staged.q[:, 0::2] | (staged.q[:, 1::2] << 4)).contiguous()
            self.scale, self.zero = staged.scale.contiguous(), staged.zero.contiguous()
            self._tensors = [self.packed, self.scale_zero, self.nibbles, self.scale, self.zero]
            self._read = [self.packed, self.scale_zero]
        else:
            self.staged = Staged(
                "int4", staged.q.to(self.device), staged.scale.to(self.device), staged.zero.to(self.device)
            )
            self._tensors = [self.staged.q, self.staged.scale, self.staged.zero]
            self._read = self._tensors

    @property
    def nbytes(self) -> int:
        """Bytes a small (decode) product reads: the kernel's copy."""
        return sum(t.numel() * t.element_size() for t in self._read)

    @property
    def resident_nbytes(self) -> int:
        """Bytes held in memory, the dequantization copy included."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w.T -> [M, N] in x's dtype."""
        if x.shape[0] == 0:
            return x.new_empty(0, self.shape[0])
        if self.native:
            bits, w, d, m = self.operands()
            return qgemm.qgemm(bits, w, d, m, x.float(), self.shape[0]).to(x.dtype)
        if self.mode == "int8":
            if self.on_cpu and x.shape[0] <= INT8_KERNEL_MAX_ROWS:
                return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale_bf16).to(x.dtype)
            return F.linear(x, self.dequantize().to(x.dtype))
        if self.on_cpu and x.shape[0] <= INT4_KERNEL_MAX_ROWS:
            return torch._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16).contiguous(), self.packed, GROUP, self.scale_zero
            ).to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype))

    def operands(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bits, w, d, m) as qgemm.c takes them; native weights only."""
        assert self.native
        w, d, m = self.tiled
        bits = (8 if self.mode == "int8" else 4) | (qgemm.AQ8 if self.int8_activations else 0)
        return bits, w, d, (d if m is None else m)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] matrix."""
        if self.native and self.mode == "int4":
            return qgemm.untile_int4(*self.tiled)
        if self.native:
            return self.tiled[0].transpose(1, 2).reshape(self.shape).float() * self.scale[:, None]
        if self.mode == "int8":
            return self.q.float() * self.scale[:, None]
        if not self.on_cpu:
            return self.staged.dequantize()
        # Nibbles land in the float buffer as two strided copies (the cast rides on the copy) and one
        # in-place addcmul scales them: faster than stack + float + addcmul, and the same values.
        n, half = self.nibbles.shape
        out = torch.empty(n, half, 2, device=self.device)
        out[..., 0].copy_(self.nibbles & 0x0F)
        out[..., 1].copy_(self.nibbles >> 4)
        groups = out.view(n, -1, GROUP)
        torch.addcmul(self.zero[..., None], groups, self.scale[..., None], out=groups)
        return out.view(n, -1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the dequantized matrix: an embedding lookup from a quantized (tied) embedding."""
        if self.mode != "int8":
            raise TypeError("row lookup needs an int8 matrix")
        if self.native and dtype == torch.float32 and ids.dim() == 1:
            return qgemm.rows8(self.tiled[0], self.tiled[1], ids)
        if self.native:
            q = self.tiled[0][ids // qgemm.TILE, :, ids % qgemm.TILE]
            return q.to(dtype) * self.scale[ids, None].to(dtype)
        return self.q[ids].to(dtype) * self.scale[ids, None].to(dtype)


def pack(
    w: torch.Tensor | Staged,
    mode: str,
    dtype: torch.dtype,
    device,
    native: bool = False,
    activations: str = "none",
) -> torch.Tensor | QuantizedWeight | qgemm.TiledFloat:
    """The weight as the model keeps it: float in `dtype`, or packed for `mode`. `native`: in the
    layout of pdserve's kernel (kernels/qgemm.py) where float32 activations on CPU allow it, float32
    weights too. A weight int4 cannot hold (odd shapes of tiny test models) stays float.
    `activations`: model.activation_quantization (QuantizedWeight)."""
    if mode == "none" or not can_quantize(w, mode):
        t = w.dequantize() if isinstance(w, Staged) else w
        cpu32 = t.device.type == "cpu" and torch.device(device).type == "cpu" and dtype == torch.float32
        if native and cpu32 and qgemm.TiledFloat.fits(t):
            return qgemm.TiledFloat(t)  # converted as it is tiled: one float32 copy made, not two
        return t.to(dtype=dtype, device=device).contiguous()
    return QuantizedWeight(as_staged(w, mode), device, native and dtype == torch.float32, activations)


def as_staged(w: torch.Tensor | Staged, mode: str) -> Staged:
    if isinstance(w, Staged):
        return w if w.mode == mode else quantize(w.dequantize(), mode)
    return quantize(w, mode)


def cat_rows(ws: list[torch.Tensor | Staged], mode: str) -> torch.Tensor | Staged:
    """Fuse matrices along their output rows (q, k, v; gate, up) before packing, so a fused
    product quantized from a file keeps the file's own groups."""
    if mode == "none" or not all(can_quantize(w, mode) for w in ws):
        return torch.cat([w.dequantize() if isinstance(w, Staged) else w.float() for w in ws], 0)
    st = [as_staged(w, mode) for w in ws]
    zero = None if mode == "int8" else torch.cat([s.zero for s in st], 0)
    return Staged(mode, torch.cat([s.q for s in st], 0), torch.cat([s.scale for s in st], 0), zero)


def weight_nbytes(w, resident: bool = False) -> int:
    if isinstance(w, (QuantizedWeight, qgemm.TiledFloat)):
        return w.resident_nbytes if resident else w.nbytes
    return w.numel() * w.element_size()


def from_gguf_blocks(raw, kind: str) -> Staged:
    """GGUF Q4_0 / Q4_1 rows ([N, bytes]) as int4 without a float copy. A 32-value block is an fp16
    scale d (Q4_1: then an fp16 minimum m) and 16 bytes whose low nibbles are values 0-15 and high
    nibbles values 16-31; w = d * q + m (Q4_1) or d * (q - 8) (Q4_0)."""
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    b = torch.from_numpy(raw.copy()).view(raw.shape[0], -1, head + 16)  # [N, K/32, block]
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float() if kind == "Q4_1" else -8 * d
    qs = b[..., head:]
    q = torch.cat([qs & 0x0F, qs >> 4], -1).reshape(raw.shape[0], -1)  # [N, K]
    return Staged("int4", q, d, m)
