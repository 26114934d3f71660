"""Where to cut a long prompt among the prefill workers of a pipeline (pure functions).

A token's prefill cost is its share of the linear layers (the same for every token) plus its
attention over the positions before it (growing with its position). Cutting at equal token counts
would leave the last chunk, which attends to the whole prompt, the slowest stage of the pipeline;
the cuts here give every chunk about the same estimated compute instead, on block boundaries.
"""

from __future__ import annotations

import math

from pdserve.model.arch import ModelArch


def attention_weight(arch: ModelArch, efficiency: float = 1.0) -> float:
    """The attention cost of one (query, key) pair relative to one token's linear work, by FLOPs:
    QK^T and PV per head against the projections and MLP of every layer. `efficiency` scales it
    (attention kernels run at another FLOP rate than GEMMs: disagg.parallel_prefill_attention_weight)."""
    h = arch.hidden_size
    ffn = (
        arch.intermediate_size
        if not arch.num_experts
        else arch.moe_intermediate_size * arch.num_experts_per_tok
    )
    if arch.is_mla:
        # Prefill expands each latent to per-head K/V (kv_b) and attends with qk-wide keys, v-wide values.
        heads, r = arch.num_heads, arch.kv_lora_rank
        qk, v = heads * arch.head_dim, heads * arch.v_head_dim
        q_proj = h * arch.q_lora_rank + arch.q_lora_rank * qk if arch.q_lora_rank else h * qk
        kv_proj = h * (r + arch.qk_rope_head_dim) + r * (heads * arch.qk_nope_head_dim + v)
        linear = q_proj + kv_proj + v * h + 3 * h * ffn
        return efficiency * (qk + v) / linear
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    linear = h * (q + 2 * kv) + q * h + 3 * h * ffn
    return efficiency * 2 * q / linear


def span_cost(start: int, end: int, weight: float) -> float:
    """Estimated compute of tokens [start, end): one unit each plus `weight` per position attended."""
    return (end - start) + weight * (end * (end + 1) - start * (start + 1)) / 2


def split_points(start: int, end: int, parts: int, block_size: int, weight: float) -> list[int]:
    """Cuts of [start, end) into `parts` chunks of about equal span_cost: the chunks' boundaries
    [start, c1, ..., end], each inner cut on a block boundary, every chunk non-empty. Fewer parts
    come back when the span is too short to give each at least one block."""
    total = span_cost(start, end, weight)
    cuts = [start]
    for k in range(1, parts):
        target = span_cost(0, start, weight) + total * k / parts  # cumulative cost from position 0
        # Solve x + weight * x (x + 1) / 2 = target for x (cost from 0 to x), then round to a block.
        a, b = weight / 2, 1 + weight / 2
        x = target / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
        cut = round(x / block_size) * block_size
        if cuts[-1] < cut < end:
            cuts.append(cut)
    return cuts + [end]


def pipeline_parts(num_uncached: int, peers: int, min_tokens: int) -> int:
    """How many prefill workers share a prompt: one below `min_tokens` (0: never split), else one
    per `min_tokens / 2` uncached tokens, at most one per peer."""
    if min_tokens <= 0 or num_uncached < min_tokens or peers < 2:
        return 1
    return max(1, min(peers, num_uncached // max(1, min_tokens // 2)))
