"""The matrix product every layer uses, through the fastest CPU path for the batch at hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model.kernels.qgemm import TiledFloat
from pdserve.model.quant import QuantizedWeight
from pdserve.utils.cpu import cpu_flags


def small_batch_rows(flags: frozenset[str]) -> int:
    """Up to how many rows w @ x.T beats F.linear on this CPU (tuned per vector ISA, see `linear`).
    With AVX2 only it wins up to about 100 rows (timed over the 30 layers + head, each weight distinct
    so none stays in cache); with AVX-512 F.linear was as fast or faster from 12 rows
    (docs/benchmarks.md)."""
    return 11 if "avx512f" in flags else 96


SMALL_BATCH_ROWS = small_batch_rows(cpu_flags())


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T. On CPU, up to SMALL_BATCH_ROWS rows (every decode step of a small batch) run as
    w @ x.T: MKL streams the weight through a faster kernel that way. One row takes a slower
    matrix-vector path either way, so it is padded to two. How far up this holds depends on the CPU (small_batch_rows).
    A quantized weight, or a float32 one in pdserve's tile layout, runs its own kernel (model/quant.py)."""
    if isinstance(w, (QuantizedWeight, TiledFloat)):
        return w.matmul(x)
    m = x.shape[0]
    if x.device.type != "cpu" or m > SMALL_BATCH_ROWS or m == 0:
        return F.linear(x, w)
    if m == 1:
        return torch.mm(w, torch.cat([x, x]).t())[:, :1].t().contiguous()
    return torch.mm(w, x.t()).t().contiguous()
