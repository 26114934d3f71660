"""Attention of a long prompt chunk that follows computed context, without a mask.

A chunk of L queries after P cached positions attends to all P and causally to its own L. With one
explicit [L, P + L] mask the kernel computes every (query, key) pair and reads the mask; split in
two, the prefix part needs no mask and the own part is plain causal (the kernel skips the upper
triangle), and the two are merged by their log-sum-exps: the same softmax over the union of keys.
This is what a later chunk of a pipelined prompt runs (disagg/pipeline.py), and any long chunk of
chunked prefill.
"""

from __future__ import annotations

import torch

MIN_QUERIES = 256  # below this the masked call is as fast and one kernel launch fewer

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, KVH, S, D] -> [1, H, S, D] (grouped-query attention: each kv head serves H / KVH query heads)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def prefix_then_causal(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [1, H, L, D]; prefix keys/values [1, KVH, P, D]; own [1, KVH, L, D]. Returns [1, H, L, D]."""
    h = q.shape[1]
    o1, lse1 = _flash(q, _heads(k_prefix, h), _heads(v_prefix, h), 0.0, False, scale=scale)
    o2, lse2 = _flash(q, _heads(k_own, h), _heads(v_own, h), 0.0, True, scale=scale)
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)
