"""Attention over a paged KV cache.

The cache of one layer is a flat tensor of slots [num_blocks * block_size, kv_heads, head_dim];
slot = block_id * block_size + offset. A step's tokens are flattened: decode tokens (one query
each) come first and are attended in one padded batch; prefill chunks follow, one call each.
Context is gathered whole blocks at a time (a block of one layer is one contiguous run of
block_size * kv_heads * head_dim values): copying runs instead of single slots made the decode
gather several times faster. The padding past a sequence's last token is masked out.
Block indices and masks are built once per step (`build_metadata`) and shared by every layer.
Decodes of very different lengths are split into a few groups so that short contexts are not
padded to the longest one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.model.chunk_attention import MIN_QUERIES, prefix_then_causal

if TYPE_CHECKING:
    from pdserve.model.kernels.prefill_attention import PrefillAttention


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk in the flattened batch
    q_len: int
    ctx_len: int  # tokens attended, this chunk included
    block_idx: (
        torch.Tensor | None
    )  # [ceil(ctx_len / block_size)] blocks; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, blocks * block_size] bool (True = attend), None means plain causal
    prefix_len: int = (
        0  # > 0: no mask; block_idx holds this many positions, attended whole (chunk_attention.py)
    )


@dataclass
class DecodeGroup:
    start: int  # first decode of the group in the flattened batch
    block_idx: torch.Tensor  # [n, Bmax] blocks, padded with block 0
    mask: torch.Tensor  # [n, 1, 1, Bmax * block_size] bool (True = attend)
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None  # attended()'s, once per step

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, ctx) int64 [n]: the attended positions [first, ctx) of each decode, read off the mask
        (the one source, also for groups rebuilt from the wire by ep_protocol)."""
        if self.bounds is None:
            m = self.mask.reshape(self.mask.shape[0], -1).to(torch.int8)
            first = m.argmax(1)
            self.bounds = (first.long(), (m.shape[1] - m.flip(1).argmax(1)).long())
        return self.bounds


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot written by each token
    block_size: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_plan: tuple[torch.Tensor, torch.Tensor] | None = None  # the native prefill kernel's, once a step

    @property
    def padded_decode_slots(self) -> int:
        return sum(g.mask.numel() for g in self.decode_groups)


MAX_DECODE_GROUPS = 4
GROUP_PADDING = 1.25  # start a new group when padding would exceed 25% of the real context


def group_by_length(ctx_lens: list[int]) -> list[tuple[int, int]]:
    """Split decodes, sorted by ascending context, into [start, end) groups of similar length."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, ctx in enumerate(ctx_lens):
        n = i - start + 1
        if i > start and ctx * n > GROUP_PADDING * (total + ctx) and len(groups) < MAX_DECODE_GROUPS - 1:
            groups.append((start, i))
            start, total = i, 0
        total += ctx
    if ctx_lens:
        groups.append((start, len(ctx_lens)))
    return groups


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    blocks = torch.tensor(block_table, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def build_metadata(
    seqs: list[tuple[list[int], int, int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device | str,
) -> AttentionMetadata:
    """seqs: (block_table, num_computed, num_new) per sequence, decodes (num_new == 1) first,
    sorted by ascending context length. A decode's slot, block row, mask and bounds are built from
    Python lists, a few tensors a group: per-sequence torch ops cost ~0.3 ms of a 6 ms batch-1 step."""
    parts: list[torch.Tensor] = []
    decode_slots: list[int] = []  # consecutive decodes' slots, one tensor when a prefill follows
    decodes, prefills = [], []
    q_start = 0
    for block_table, computed, new in seqs:
        ctx = computed + new
        if new == 1 and computed > 0:
            decode_slots.append(block_table[computed // block_size] * block_size + computed % block_size)
            decodes.append((block_table, ctx))
        else:
            if decode_slots:
                parts.append(torch.tensor(decode_slots, dtype=torch.long))
                decode_slots = []
            parts.append(_slots(block_table, computed, ctx, block_size))
            if computed == 0 and sliding_window is None:
                prefills.append(PrefillChunk(q_start, new, ctx, None, None))
            elif sliding_window is None and new >= MIN_QUERIES and torch.device(device).type == "cpu":
                # A long chunk after computed context: the context whole, the chunk causal, no mask.
                blocks = torch.tensor(block_table[: -(-computed // block_size)], dtype=torch.long)
                prefills.append(PrefillChunk(q_start, new, ctx, blocks.to(device), None, prefix_len=computed))
            else:
                nblk = -(-ctx // block_size)
                q_pos = torch.arange(computed, ctx).unsqueeze(1)
                k_pos = torch.arange(nblk * block_size).unsqueeze(0)
                mask = k_pos <= q_pos  # also masks the padding after ctx: q_pos < ctx
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
                blocks = torch.tensor(block_table[:nblk], dtype=torch.long)
                prefills.append(PrefillChunk(q_start, new, ctx, blocks.to(device), mask.to(device)))
        q_start += new
    if decode_slots:
        parts.append(torch.tensor(decode_slots, dtype=torch.long))
    meta = AttentionMetadata(
        slot_mapping=(parts[0] if len(parts) == 1 else torch.cat(parts)).to(device),
        block_size=block_size,
        prefills=prefills,
    )
    for lo, hi in group_by_length([ctx for _, ctx in decodes]):
        group = decodes[lo:hi]
        bmax = -(-max(ctx for _, ctx in group) // block_size)
        rows = []
        for table, ctx in group:
            nblk = -(-ctx // block_size)
            rows.append(table[:nblk] + [0] * (bmax - nblk))
        ctxs = torch.tensor([ctx for _, ctx in group], dtype=torch.long)
        firsts = (
            (ctxs - sliding_window).clamp_(min=0) if sliding_window is not None else torch.zeros_like(ctxs)
        )
        pos = torch.arange(bmax * block_size)
        mask = (pos >= firsts[:, None]) & (pos < ctxs[:, None])
        meta.decode_groups.append(
            DecodeGroup(
                lo,
                torch.tensor(rows, dtype=torch.long).to(device),
                mask.view(hi - lo, 1, 1, -1).to(device),
                (firsts.to(device), ctxs.to(device)),
            )
        )
    return meta


def prefill_plan(meta: AttentionMetadata, kernel: PrefillAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill kernel's description of the step's chunks, built once a step (every layer's)."""
    if meta.prefill_plan is None:
        meta.prefill_plan = kernel.plan(
            [(p.q_start, p.q_len, p.ctx_len - p.q_len, p.block_idx) for p in meta.prefills]
        )
    return meta.prefill_plan


def _gather_blocks(cache: torch.Tensor, block_idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(block_idx.view(-1)) * block_size, KVH, D]: the cache's slots of those blocks, in order.
    index_select copies each block as one run; it is also several times faster than advanced
    indexing for this gather on CPU."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])
    return blocks.index_select(0, block_idx.reshape(-1)).view(-1, *cache.shape[1:])


# (q, k_cache, v_cache, block_idx, first, ctx, block_size, scale, out): decodes read in place
# (model/kernels/decode_attention.py), writing into out.
DecodeKernel = Callable[..., None]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillAttention | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for this step's tokens. Writes k, v into the cache first.
    With `decode_kernel` (float32 on CPU), decodes skip the gather and the padded batch; with
    `prefill_kernel`, every prefill chunk is attended in one native call, its keys read in place. A cache of
    another dtype than q's (cache.kv_dtype) holds k and v rounded to it, and every query attends to
    the rounded values, its own step's too: a prefix-cache hit reads what a miss computed with."""
    kv_dtype = k_cache.dtype
    if kv_dtype != k.dtype:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if kv_dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    bs = meta.block_size

    def gather(cache: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
        return _gather_blocks(cache, block_idx, bs).to(q.dtype)

    out = torch.empty_like(q)
    for g in meta.decode_groups:
        n = g.block_idx.shape[0]
        if decode_kernel is not None:
            first, ctx = g.attended()
            decode_kernel(
                q[g.start : g.start + n],
                k_cache,
                v_cache,
                g.block_idx,
                first,
                ctx,
                bs,
                scale,
                out[g.start : g.start + n],
            )
            continue
        shape = (n, -1, *k_cache.shape[1:])
        kd = gather(k_cache, g.block_idx).view(shape).transpose(1, 2)  # [n, KVH, L, D]
        vd = gather(v_cache, g.block_idx).view(shape).transpose(1, 2)
        qd = q[g.start : g.start + n].unsqueeze(2)  # [n, H, 1, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale, enable_gqa=True)
        if n == q.shape[0]:
            return o.squeeze(2)  # the whole step is this group: no copy into `out`
        out[g.start : g.start + n] = o.squeeze(2)
    if meta.prefills and prefill_kernel is not None and prefill_kernel.takes(q.shape[2]):
        prefill_kernel(q, k, v, k_cache, v_cache, bs, prefill_plan(meta, prefill_kernel), scale, out)
        return out
    for p in meta.prefills:
        qp = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if p.prefix_len:
            own = [x[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0) for x in (k, v)]
            pre = [
                gather(c, p.block_idx)[: p.prefix_len].transpose(0, 1).unsqueeze(0)
                for c in (k_cache, v_cache)
            ]
            o = prefix_then_causal(qp, pre[0], pre[1], own[0], own[1], scale)
            out[p.q_start : p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
            continue
        if p.block_idx is None:
            kp = k[p.q_start : p.q_start + p.q_len]
            vp = v[p.q_start : p.q_start + p.q_len]
        else:
            kp = gather(k_cache, p.block_idx)
            vp = gather(v_cache, p.block_idx)
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )
        out[p.q_start : p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
    return out
