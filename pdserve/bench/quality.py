"""How far a quantized model's next-token distributions are from float32's: teacher-forced over the
same token sequence (the float model's own greedy continuation), so both models see identical inputs
at every step and one divergent token cannot compound."""

from __future__ import annotations

import torch

from pdserve.model.attention import build_metadata


def sequence_logits(
    model, ids: list[int], block: int = 16, chunk: int | None = None, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one sequence over a paged KV cache (of `kv_dtype`, else the
    model's): in a single pass, or `chunk` positions a pass (a chunked prefill: the kernels then see
    at most that many rows)."""
    a = model.arch
    blocks = list(range((len(ids) + block - 1) // block))
    kv = torch.zeros(a.kv_cache_shape(len(blocks) * block), dtype=kv_dtype or model.dtype)
    n = len(ids)
    step = chunk or max(n, 1)
    out = []
    for s in range(0, n, step):
        e = min(n, s + step)
        meta = build_metadata([(blocks, s, e - s)], block, a.sliding_window, "cpu")
        rows = torch.arange(e - s)  # every position's logits
        out.append(model.forward(torch.tensor(ids[s:e]), torch.arange(s, e), meta, kv, rows).float())
    return torch.cat(out)


def agreement_and_kl(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || other) over the rows (positions) of two logit matrices."""
    agree = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return agree, kl
