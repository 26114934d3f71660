"""Causal attention of a step's prefill chunks through prefill_attention.c: one call for all of them,
keys and values read where they lie (see the C file for the layout and why)."""

from __future__ import annotations

import ctypes

import torch

from pdserve.model.kernels.decode_attention import kv_bf16
from pdserve.model.kernels.native import function, load, ptr

_I, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class PrefillAttention:
    """Callable as (q [T, H, D], k, v [T, KVH, D] (the step's own, float32), k_cache, v_cache, block
    size, plan, scale, out [T, H, D]); writes each planned chunk's rows of out. `window`: the model's
    sliding window (0: none)."""

    def __init__(self, fn, width: int, window: int) -> None:
        self._fn = fn
        self.width = width  # a head dimension must be a multiple of the build's vector width
        self.window = window

    def takes(self, head_dim: int) -> bool:
        return head_dim % self.width == 0

    @staticmethod
    def plan(chunks: list[tuple[int, int, int, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's description of a step's chunks, each (first row, rows, positions before it,
        the block table covering those positions or None where there are none); built once a step."""
        desc, tables, off = [], [], 0
        for q_start, rows, before, table in chunks:
            if before == 0:
                desc += [q_start, rows, 0, -1]
                continue
            assert table is not None, "a chunk after context needs its block table"
            desc += [q_start, rows, before, off]
            tables.append(table.reshape(-1).to(torch.int64))
            off += tables[-1].numel()
        table_t = torch.cat(tables) if tables else torch.zeros(1, dtype=torch.int64)
        return torch.tensor(desc, dtype=torch.int64), table_t

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_size: int,
        plan: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        t, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        if k.stride(0) != v.stride(0) or any(x.stride(1) != d or x.stride(2) != 1 for x in (k, v)):
            k, v = k.contiguous(), v.contiguous()
        assert out.stride(2) == 1 and out.stride(1) == d
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
        desc, tables = plan
        self._fn(
            ptr(q),
            q.stride(0),
            ptr(k),
            ptr(v),
            k.stride(0),
            ptr(k_cache),
            ptr(v_cache),
            kv_bf16(k_cache),
            ptr(tables),
            ptr(desc),
            desc.numel() // 4,
            block_size,
            h,
            k.shape[1],
            d,
            scale,
            self.window,
            ptr(out),
            out.stride(0),
            torch.get_num_threads(),
        )


def prefill_attention_kernel(window: int | None = None) -> PrefillAttention | None:
    """The native kernel, or None where it cannot be built (torch's attention runs instead)."""
    fn = function(
        "prefill_attention",
        "pd_prefill_attention",
        [_P, _I64, _P, _P, _I64, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I64, _P, _I64, _I],
    )
    lib = load("prefill_attention")
    if fn is None or lib is None:
        return None
    lib.pd_prefill_attention_width.restype = ctypes.c_int
    return PrefillAttention(fn, int(lib.pd_prefill_attention_width()), window or 0)
