"""A MoE layer's routed experts through moe.c, one native call for every active expert of a step."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from pdserve.model.kernels.native import function, ptr

_I, _I64, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


class Experts(ctypes.Structure):
    _fields_ = [
        ("bits", _I),
        ("n", _I),
        ("k", _I),
        ("w", _P),
        ("d", _P),
        ("m", _P),
        ("sw", _I64),
        ("sd", _I64),
        ("sm", _I64),
    ]


@lru_cache(maxsize=1)
def _fn():
    return function("moe", "pd_moe", [_P, _P, _I, _I, _P, _P, _I, _I, _P, _I64, _P, _I64, _I])


def available() -> bool:
    return _fn() is not None


def experts_struct(bits: int, n: int, k: int, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Experts:
    """A stack's operands (slot first, each slot contiguous) as moe.c reads them."""

    def stride(t: torch.Tensor) -> int:
        return t.stride(0) * t.element_size()

    return Experts(bits, n, k, w.data_ptr(), d.data_ptr(), m.data_ptr(), stride(w), stride(d), stride(m))


def grouped_moe(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    lo: int,
    hi: int,
    gate_up: Experts,
    down: Experts,
) -> torch.Tensor:
    """x [T, H] float32; slots [T, k] int64 (physical, this rank's in [lo, hi)); weights [T, k] float32
    -> [T, H]: each token's weighted sum over its choices in [lo, hi) of its expert's SwiGLU."""
    fn = _fn()
    assert fn is not None and x.dtype == torch.float32 and x.stride(1) == 1
    slots = slots.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    t, k = slots.shape
    out = torch.empty(t, x.shape[1], dtype=torch.float32)
    fn(
        ctypes.byref(gate_up),
        ctypes.byref(down),
        t,
        k,
        ptr(slots),
        ptr(weights),
        lo,
        hi,
        ptr(x),
        x.stride(0),
        ptr(out),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out
