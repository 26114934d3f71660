"""RMSNorm through norm.c: one pass a row instead of torch's chain of small ops (see the C file)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from pdserve.model.kernels.native import function, ptr

_I, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@lru_cache(maxsize=1)
def _fn():
    return function("norm", "pd_rms_norm", [_P, _I64, _P, _P, _I64, _I, _I, _F, _I])


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [rows, n] float32 on the CPU, rows unit-strided; None where the kernel does not apply or load."""
    if (
        x.dim() != 2
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.stride(1) != 1
        or not weight.is_contiguous()
    ):
        return None
    fn = _fn()
    if fn is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    fn(
        ptr(x),
        x.stride(0),
        ptr(weight),
        ptr(out),
        out.stride(0),
        x.shape[0],
        x.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return out
