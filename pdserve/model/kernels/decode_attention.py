"""Paged decode attention through decode_attention.c: reads each sequence's keys and values in place
instead of gathering them into a padded copy (see the C file for the layout it expects)."""

from __future__ import annotations

import ctypes

import torch

from pdserve.model.kernels.native import function, ptr

_I, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# pd_decode_attention's arguments (decode_attention.c)
ARGTYPES = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I, _I]


def kv_bf16(cache: torch.Tensor) -> int:
    """The kernels' flag for a cache's type: 1 for bfloat16 (cache.kv_dtype), 0 for float32, the two
    they read and write (decode_attention.c, layer.c)."""
    if cache.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the native kernels keep keys and values in float32 or bfloat16, not {cache.dtype}")
    return int(cache.dtype == torch.bfloat16)


class DecodeAttention:
    """Callable as (q [n, H, D], k_cache, v_cache [slots, KVH, D], block_idx [n, B], first, ctx [n],
    scale, out [n, H, D]); float32 CPU tensors only (the caller checks), the caches float32 or
    bfloat16 (cache.kv_dtype)."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_idx: torch.Tensor,
        first: torch.Tensor,
        ctx: torch.Tensor,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        n, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        assert out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_idx.dtype == first.dtype == ctx.dtype == torch.int64 and block_idx.stride(1) == 1
        assert k_cache.dtype == v_cache.dtype
        self._fn(
            ptr(q),
            q.stride(0),
            ptr(k_cache),
            ptr(v_cache),
            ptr(block_idx),
            block_idx.stride(0),
            ptr(first.contiguous()),
            ptr(ctx.contiguous()),
            ptr(out),
            n,
            h,
            k_cache.shape[1],
            d,
            block_size,
            scale,
            torch.get_num_threads(),
            kv_bf16(k_cache),
        )


def decode_attention_kernel() -> DecodeAttention | None:
    """The native kernel, or None where it cannot be built (the torch path runs instead)."""
    fn = function("decode_attention", "pd_decode_attention", ARGTYPES)
    return None if fn is None else DecodeAttention(fn)
