"""A MoE layer's expert weights stacked along a leading slot dimension, in the formats of dense weights.

One `ExpertStack` holds one matrix of every expert (gate/up fused [2I, H], or down [H, I]), either
as a plain tensor [E, N, K] in the model dtype, or in qgemm.c's tile layout (kernels/qgemm.py) with
the slot first:

- f32: float32 tiles [E, N/16, K, 16];
- int8: q [E, N/16, K, 16] int8 and d [E, N/16, 16] float32 (a scale per output channel);
- int4: nib [E, N/16, K/2, 16] uint8 and d, m [E, N/16, K/32, 16] float16 (GGUF's Q4_1, groups of 32).

These are the bytes of the dense formats (quant.py), a slot after another, so one expert is a
contiguous slice of each tensor: the weight mover copies a slot with one copy per tensor, and the
grouped MoE kernel (kernels/moe.c) reaches slot s at a fixed stride. Shapes the tiles cannot hold
(N % 16, K % 32) stay plain float, as int4's odd shapes do for dense weights.

A stack is packed from a float [E, N, K] tensor or from an `ExpertSource`, a checkpoint's experts
read one at a time: each is converted or quantized into its slot as it arrives, so loading holds
the packed stack and one expert's stored copy and scratch, never the layer's experts in another
format beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.model.kernels import moe as moe_kernel
from pdserve.model.kernels import qgemm
from pdserve.model.linear import linear
from pdserve.model.quant import quantize

TILE = qgemm.TILE
BITS = {"f32": 32, "int8": 8, "int4": 4}


def fits_tiles(n: int, k: int) -> bool:
    return n % TILE == 0 and k % 32 == 0


class ExpertSource:
    """One matrix ([N, K]) of every expert of a MoE layer, still in the checkpoint: `expert(i)` reads
    expert i's, in its stored float dtype or converted as the reader converts."""

    def __init__(self, shape: tuple[int, int, int], read: Callable[[int], torch.Tensor]) -> None:
        self.shape = (int(shape[0]), int(shape[1]), int(shape[2]))
        self._read = read

    def __len__(self) -> int:
        return self.shape[0]

    def expert(self, i: int) -> torch.Tensor:
        w = self._read(i)
        if tuple(w.shape) != self.shape[1:]:
            raise ValueError(
                f"expert {i}: a [{', '.join(map(str, w.shape))}] matrix, expected {list(self.shape[1:])}"
            )
        return w


class ExpertStack:
    """`kind`: plain, f32, int8 or int4; `shape`: (N, K) of one expert's matrix; `tensors`: the
    format's tensors, each with the slot first. `native`: products may run pdserve's kernels."""

    def __init__(
        self,
        kind: str,
        shape: tuple[int, int],
        tensors: tuple[torch.Tensor, ...],
        native: bool,
        activations: str = "none",
    ):
        self.kind, self.shape, self.tensors, self.native = (
            kind,
            (int(shape[0]), int(shape[1])),
            tensors,
            native,
        )
        # model.activation_quantization: "int8" gives an int8 or int4 stack's products int8 activations
        # (kernels/qgemm_q8.c), in the grouped kernel and the slot-by-slot path alike.
        self.activations = activations
        self._struct: moe_kernel.Experts | None = None

    # ------------------------------------------------------------ building

    @classmethod
    def pack(
        cls, w: torch.Tensor | ExpertSource, mode: str, dtype: torch.dtype, device, native: bool = True
    ) -> ExpertStack:
        """w [E, N, K] (any float dtype, or read expert by expert from a checkpoint) packed for `mode`
        (none, int8, int4). `native`: float32 weights take the tile layout too where the kernels build
        (quantized ones always do: the layout is plain torch, and without the kernels each product
        dequantizes its expert)."""
        e, n, k = w.shape
        device = torch.device(device)
        native = native and device.type == "cpu" and qgemm.available()
        src = w if isinstance(w, ExpertSource) else None
        if not fits_tiles(n, k) or (mode == "none" and not (native and dtype == torch.float32)):
            if src is None:
                return cls("plain", (n, k), (w.to(dtype=dtype, device=device).contiguous(),), native)
            plain = torch.empty(e, n, k, dtype=dtype, device=device)
            for i in range(e):
                plain[i].copy_(src.expert(i))
            return cls("plain", (n, k), (plain,), native)
        t = n // TILE
        if mode == "none":
            tiles = torch.empty(e, t, k, TILE, dtype=torch.float32)
            if src is None:
                tiles.copy_(w.reshape(e, t, TILE, k).transpose(2, 3))  # converted as it is laid out: one copy
            else:
                for i in range(e):
                    tiles[i].copy_(src.expert(i).reshape(t, TILE, k).transpose(1, 2))
            return cls("f32", (n, k), (tiles.to(device),), native)
        if mode == "int8":
            out = (torch.empty(e, t, k, TILE, dtype=torch.int8), torch.empty(e, t, TILE))
        elif mode == "int4":
            out = (
                torch.empty(e, t, k // 2, TILE, dtype=torch.uint8),
                torch.empty(e, t, k // 32, TILE, dtype=torch.float16),
                torch.empty(e, t, k // 32, TILE, dtype=torch.float16),
            )
        else:
            raise ValueError(f"unknown quantization {mode!r}")
        for i in range(e):  # one expert's float32 scratch at a time
            st = quantize(w[i] if src is None else src.expert(i), mode)
            parts = (
                qgemm.tile_int8(st.q, st.scale)
                if mode == "int8"
                else qgemm.tile_int4(st.q, st.scale, st.zero)
            )
            for dst, src_part in zip(out, parts):
                dst[i].copy_(src_part)
        return cls(mode, (n, k), tuple(x.to(device) for x in out), native)

    def __getstate__(self) -> dict:
        # Sent to expert-parallel ranks (tensors in shared memory); the kernel's struct holds addresses.
        return {**self.__dict__, "_struct": None}

    @classmethod
    def plain(cls, w: torch.Tensor) -> ExpertStack:
        """A float [E, N, K] stack used as it is."""
        return cls("plain", tuple(w.shape[1:]), (w,), False)

    # ------------------------------------------------------------ slots

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __getitem__(self, idx) -> ExpertStack:
        """Slots `idx` (a slice: views; an index tensor: a copy)."""
        return ExpertStack(
            self.kind, self.shape, tuple(t[idx] for t in self.tensors), self.native, self.activations
        )

    def to(self, device) -> ExpertStack:
        return ExpertStack(
            self.kind, self.shape, tuple(t.to(device) for t in self.tensors), self.native, self.activations
        )

    def with_activations(self, activations: str) -> ExpertStack:
        """The same tensors (shared, not copied) with products taking `activations`."""
        if activations == self.activations:
            return self
        return ExpertStack(self.kind, self.shape, self.tensors, self.native, activations)

    def empty_like(self) -> ExpertStack:
        return ExpertStack(
            self.kind,
            self.shape,
            tuple(torch.empty_like(t) for t in self.tensors),
            self.native,
            self.activations,
        )

    def copy_slot_(self, s: int, src: ExpertStack, e: int) -> None:
        """Slot s := slot e of `src` (same format)."""
        for a, b in zip(self.tensors, src.tensors):
            a[s].copy_(b[e])

    def share_memory_(self) -> ExpertStack:
        for t in self.tensors:
            t.share_memory_()
        return self

    def shares_storage(self, other: ExpertStack) -> bool:
        a, b = self.tensors[0].untyped_storage(), other.tensors[0].untyped_storage()
        return a.data_ptr() == b.data_ptr()

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def bits(self) -> int | None:
        return BITS.get(self.kind)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    # ------------------------------------------------------------ values and products

    def operands(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bits, w, d, m) as qgemm.c takes them, each with the slot first (tiled kinds only)."""
        w = self.tensors[0]
        if self.kind == "f32":
            return 32, w, w, w
        flag = qgemm.AQ8 if self.activations == "int8" else 0
        if self.kind == "int8":
            return 8 | flag, w, self.tensors[1], self.tensors[1]
        return 4 | flag, w, self.tensors[1], self.tensors[2]

    def kernel_ready(self) -> bool:
        """Whether the grouped kernel (kernels/moe.c) runs this stack's products."""
        return self.native and self.kind in BITS and self.device.type == "cpu" and moe_kernel.available()

    def kernel_struct(self) -> moe_kernel.Experts:
        """The stack as moe.c reads it (built once: the tensors never move, the mover writes into them)."""
        if self._struct is None:
            self._struct = moe_kernel.experts_struct(self.operands()[0], *self.shape, *self.operands()[1:])
        return self._struct

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every slot's [N, K] matrix, dequantized: [E, N, K]."""
        n, k = self.shape
        if self.kind == "plain":
            return self.tensors[0].to(dtype)
        e, t = len(self), n // TILE
        if self.kind == "f32":
            w = self.tensors[0]
        elif self.kind == "int8":
            q, d = self.tensors
            w = q.float() * d[:, :, None, :]
        else:
            nib, d, m = self.tensors
            q = torch.stack([nib & 0x0F, nib >> 4], 3).view(e, t, k // 32, 32, TILE).float()
            w = (q * d.float()[:, :, :, None] + m.float()[:, :, :, None]).view(e, t, k, TILE)
        return w.transpose(2, 3).reshape(e, n, k).to(dtype)

    def matmul(self, s: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ slot s's matrix.T -> [M, N] in x's dtype."""
        if self.kind == "plain":
            return linear(x, self.tensors[0][s])
        if self.native and x.dtype == torch.float32 and x.device.type == "cpu":
            bits, w, d, m = self.operands()
            return qgemm.qgemm(bits, w[s], d[s], m[s], x, self.shape[0])
        return F.linear(x, self[s : s + 1].dense(x.dtype)[0])
