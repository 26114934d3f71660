"""How far a quantized model's next-token distributions are from float32's: teacher-forced over the
same token sequence (the float model's own greedy continuation), so both models see identical inputs
at every step and one divergent token cannot compound."""

from __future__ import annotations

import torch

from pdserve.model.attention import build_metadata


def sequence_logits(model, ids: list[int], block: int = 16) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one sequence, in a single pass over a paged KV cache."""
    a = model.arch
    blocks = list(range((len(ids) + block - 1) // block))
    kv = torch.zeros(a.kv_cache_shape(len(blocks) * block), dtype=model.dtype)
    meta = build_metadata([(blocks, 0, len(ids))], block, a.sliding_window, "cpu")
    n = len(ids)
    return model.forward(torch.tensor(ids), torch.arange(n), meta, kv, torch.arange(n)).float()


def agreement_and_kl(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || other) over the rows (positions) of two logit matrices."""
    agree = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return agree, kl
