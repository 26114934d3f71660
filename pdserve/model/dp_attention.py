"""Data-parallel attention for expert parallelism: a step's sequences shared out over the ranks.

Every rank receives the whole step (ep_protocol.py) and computes the same split from it, so the split
itself never travels. A sequence of the step (one decode row, or one prefill chunk) goes whole to one
rank, which runs its attention, its dense layers and its shared experts; only the routed experts'
rows travel between ranks (ep_exchange.py). The split balances each rank's cost: a token's
non-expert products plus the keys its queries attend, longest first onto the least loaded rank (the
LPT rule), ties to the lower rank, so a step's cost per rank stays within one sequence of the mean.

The KV pool of one host is shared by its ranks (rank 0's pool in /dev/shm), so a sequence may run
on a different rank from one step to the next without moving its KV. Ranks that cannot share it
(other hosts) keep their own pools: rank 0 then chooses the split itself, counting the KV blocks
each rank would have to be sent, and sends it with the step (ep_kv.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.model.arch import ModelArch
from pdserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk


@dataclass
class StepShare:
    """One rank's part of a step."""

    tokens: torch.Tensor  # int64 [t]: the step's token rows this rank computes, in its own order
    meta: AttentionMetadata  # their attention metadata, rows renumbered 0..t-1
    logits_rows: torch.Tensor  # int64 [l]: rows of `tokens` whose logits the step wants
    logits_order: torch.Tensor  # int64 [l]: where each of those rows goes in the step's logits
    attended: int  # keys attended by this rank's queries (KV read by its attention)


def token_cost(arch: ModelArch) -> int:
    """A token's non-expert work in attended-key units: the attention projections' multiply-adds per
    token ÷ those of one attended key (q·k and p·v over every head)."""
    h = arch.hidden_size
    q = arch.num_heads * arch.head_dim
    kv = 2 * arch.num_kv_heads * arch.head_dim
    return max(1, (h * (q + kv) + q * h) // (2 * q))


def step_units(meta: AttentionMetadata) -> list[tuple[int, int, int, int]]:
    """(kind, index, tokens, attended keys) of every sequence: kind 0 a decode row (index: its token
    row in the step), 1 a prefill chunk (index into meta.prefills)."""
    out = []
    for g in meta.decode_groups:
        first, ctx = g.attended()
        for j, a in enumerate((ctx - first).tolist()):
            out.append((0, g.start + j, 1, int(a)))
    for i, p in enumerate(meta.prefills):
        # A chunk's queries attend on average half the chunk plus what came before it.
        out.append((1, i, p.q_len, p.q_len * (p.ctx_len - p.q_len) + p.q_len * (p.q_len + 1) // 2))
    return out


def assign(
    units: list[tuple[int, int, int, int]],
    world: int,
    per_token: int,
    extra: list[list[int]] | None = None,
) -> list[int]:
    """The rank of each unit: largest cost (tokens x per_token + attended keys) first onto the rank
    where it would finish first (ties: the lower rank); `extra[u][r]`, where given, is what placing
    unit u on rank r costs beyond that (its KV blocks the rank lacks, ep_kv.py). Without it this is
    the LPT rule: the least loaded rank."""
    cost = [n * per_token + keys for _, _, n, keys in units]
    load = [0] * world
    ranks = [0] * len(units)
    for u in sorted(range(len(units)), key=lambda u: (-cost[u], u)):
        add = extra[u] if extra is not None else [0] * world
        r = min(range(world), key=lambda r: (load[r] + add[r], r))
        ranks[u] = r
        load[r] += cost[u] + add[r]
    return ranks


def split_step(
    meta: AttentionMetadata,
    num_tokens: int,
    logits_indices: torch.Tensor | None,
    world: int,
    per_token: int,
    ranks: list[int] | None = None,
) -> list[StepShare]:
    """Each rank's share of a step: its sequences' rows, their metadata, and its logits rows; `ranks`
    (one per unit of `step_units(meta)`), where given, is the assignment, else `assign`'s."""
    units = step_units(meta)
    if ranks is None:
        ranks = assign(units, world, per_token)
    elif len(ranks) != len(units):
        raise ValueError(f"{len(ranks)} ranks for a step of {len(units)} sequences")
    want = logits_indices.tolist() if logits_indices is not None else []
    where = {t: i for i, t in enumerate(want)}
    shares = []
    for r in range(world):
        mine = [u for u, rk in zip(units, ranks) if rk == r]
        tokens: list[int] = []
        groups: list[DecodeGroup] = []
        chunks: list[PrefillChunk] = []
        # Decode rows first, group by group (as build_metadata lays a step out), then the chunks.
        picked = {u[1] for u in mine if u[0] == 0}
        for g in meta.decode_groups:
            sel = [j for j in range(g.block_idx.shape[0]) if (g.start + j) in picked]
            if not sel:
                continue
            idx = torch.tensor(sel, dtype=torch.long, device=g.block_idx.device)
            first, ctx = g.attended()
            groups.append(
                DecodeGroup(
                    len(tokens),
                    g.block_idx.index_select(0, idx),
                    g.mask.index_select(0, idx),
                    (first.index_select(0, idx), ctx.index_select(0, idx)),
                )
            )
            tokens += [g.start + j for j in sel]
        for u in mine:
            if u[0] == 1:
                p = meta.prefills[u[1]]
                chunks.append(replace(p, q_start=len(tokens)))
                tokens += range(p.q_start, p.q_start + p.q_len)
        dev = meta.slot_mapping.device
        tok = torch.tensor(tokens, dtype=torch.long)
        local = [(i, where[t]) for i, t in enumerate(tokens) if t in where]
        shares.append(
            StepShare(
                tok,
                AttentionMetadata(
                    slot_mapping=meta.slot_mapping.index_select(0, tok.to(dev)),
                    block_size=meta.block_size,
                    decode_groups=groups,
                    prefills=chunks,
                ),
                torch.tensor([i for i, _ in local], dtype=torch.long),
                torch.tensor([o for _, o in local], dtype=torch.long),
                sum(u[3] for u in mine),
            )
        )
    if sum(s.tokens.numel() for s in shares) != num_tokens:
        raise ValueError(f"a step of {num_tokens} tokens split into {sum(s.tokens.numel() for s in shares)}")
    return shares
