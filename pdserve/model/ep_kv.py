"""KV of expert-parallel ranks that keep pools of their own (ranks on other hosts).

Ranks on one host map rank 0's pool, so any rank can attend any sequence. A rank on another host
cannot: it keeps a private pool with the same block ids, and rank 0's pool stays complete, since
everything outside the model (prefix cache, tiers, PD transfer, migration, KV events) reads and
writes rank 0's pool alone. Per step, with data-parallel attention:

- rank 0 chooses the split itself (dp_attention.assign), counting against a rank the context
  blocks it lacks, so a sequence stays where its KV is unless moving it buys balance; the
  assignment travels with the step;
- before the step rank 0 sends each rank the blocks its sequences read and it lacks (`ship`);
- after it each rank sends rank 0 the KV rows its tokens wrote (`mirror`).

Rank 0 records which rank holds which block (`Residency`): a block is valid on a rank when that
rank's copy equals rank 0's at every position written so far. Computing a sequence or being sent
its blocks makes them valid there; another rank's write into a block, or a new allocation of it (its
content comes from elsewhere next: a prefill worker, a tier, a migration), makes it invalid. Blocks
travel as their bytes, every layer at once; nothing is pickled.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.model.attention import AttentionMetadata
from pdserve.model.dp_attention import StepShare, assign


@dataclass
class UnitKV:
    read: list[int]  # blocks holding the context before the unit's first new token
    written: list[int]  # blocks its new tokens are written into


@dataclass
class StepPlan:
    ranks: list[int]  # the rank of each unit (dp_attention.step_units)
    ship: list[list[int]]  # per rank, the blocks rank 0 sends it before the step (none for rank 0)
    kv: list[UnitKV] | None = None  # rank 0's: what each unit reads and writes


def unit_kv(meta: AttentionMetadata, units: list[tuple[int, int, int, int]]) -> list[UnitKV]:
    """The blocks each unit reads and writes, from the step's metadata."""
    bs, slots = meta.block_size, meta.slot_mapping.cpu()
    rows = {}
    for g in meta.decode_groups:
        first, ctx = g.attended()
        for j, (f, c) in enumerate(zip(first.tolist(), ctx.tolist())):
            rows[g.start + j] = (g, j, f, c)
    out = []
    for kind, idx, _, _ in units:
        if kind == 0:
            g, j, first, ctx = rows[idx]
            end = ctx - 1  # the new token is the last attended position
            read = g.block_idx[j, first // bs : (end - 1) // bs + 1].tolist() if end > first else []
            new = slots[idx : idx + 1]
        else:
            p = meta.prefills[idx]
            end = p.ctx_len - p.q_len
            read = p.block_idx[: (end - 1) // bs + 1].tolist() if end > 0 and p.block_idx is not None else []
            new = slots[p.q_start : p.q_start + p.q_len]
        out.append(UnitKV(read, sorted(set((new // bs).tolist()))))
    return out


class Residency:
    """Rank 0's record of the blocks each rank's pool holds valid (rank 0's: all of them)."""

    def __init__(self, world: int, num_blocks: int) -> None:
        self.world, self.num_blocks = world, num_blocks
        self.valid = np.zeros((world, num_blocks), dtype=bool)
        self.valid[0] = True
        self._lock = threading.Lock()  # allocations come from the engine's other threads too

    def allocated(self, blocks: list[int]) -> None:
        """`blocks` were handed out anew: whatever the other ranks hold of them is stale."""
        with self._lock:
            self.valid[1:, blocks] = False

    def plan(
        self, meta: AttentionMetadata, units: list[tuple[int, int, int, int]], per_token: int
    ) -> StepPlan:
        """The step's split and what to send where. A block a rank lacks costs it as much as attending
        the block's keys once more, and moving a sequence off the rank holding it to rank 0 costs one
        block (its last block, stale there next time): a sequence moves only where that buys balance."""
        kv = unit_kv(meta, units)
        bs = meta.block_size
        with self._lock:
            extra = []
            for k in kv:
                lack = [int((~self.valid[r, k.read]).sum()) for r in range(1, self.world)]
                held = bool(k.read) and 0 in lack
                extra.append([bs if held else 0] + [n * bs for n in lack])
            ranks = assign(units, self.world, per_token, extra)
            ship: list[list[int]] = [[] for _ in range(self.world)]
            for r in range(1, self.world):
                want = {b for k, rk in zip(kv, ranks) if rk == r for b in k.read}
                ship[r] = sorted(b for b in want if not self.valid[r, b])
        return StepPlan(ranks, ship, kv)

    def update(self, plan: StepPlan) -> None:
        """After the step ran: the blocks sent and the blocks each rank computed are valid there; a
        block written on one rank is stale on the others (rank 0 got the rows: it stays valid)."""
        with self._lock:
            for r, blocks in enumerate(plan.ship):
                if r and blocks:
                    self.valid[r, blocks] = True
            for k, r in zip(plan.kv or [], plan.ranks):
                if k.written:
                    self.valid[1:, k.written] = False
                if r:
                    self.valid[r, k.read + k.written] = True


def encode_plan(plan: StepPlan) -> torch.Tensor:
    """int64: the rank of each unit, then per rank 1..N-1 its block count and blocks."""
    out = list(plan.ranks)
    for blocks in plan.ship[1:]:
        out += [len(blocks), *blocks]
    return torch.tensor(out, dtype=torch.long)


def decode_plan(t: torch.Tensor, num_units: int, world: int) -> StepPlan:
    v = t.tolist()
    ranks, off, ship = v[:num_units], num_units, [[]]
    for _ in range(1, world):
        n = v[off]
        ship.append(v[off + 1 : off + 1 + n])
        off += 1 + n
    return StepPlan(ranks, ship)


# ------------------------------------------------------------------ moving the bytes


def _by_block(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """[layers, planes, blocks, block_size, heads, dim]: a view of the pool."""
    layers, planes, slots, heads, dim = kv.shape
    return kv.view(layers, planes, slots // block_size, block_size, heads, dim)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] as n rows of bytes (every dtype travels the same way)."""
    return t.contiguous().view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def ship(comm, kv: torch.Tensor, block_size: int, ship: list[list[int]]) -> int:
    """Rank 0 sends each rank the blocks `ship[r]`, every layer; that rank writes them into its pool
    at the same ids. Every rank calls this with the same `ship`. Returns the bytes rank 0 sent."""
    sizes = [len(b) for b in ship]
    if not any(sizes):
        return 0
    world, rank, pool = comm.world, comm.rank, _by_block(kv, block_size)
    width = pool[:, :, :1].numel() * kv.element_size()
    if rank == 0:
        idx = torch.tensor([b for blocks in ship for b in blocks], dtype=torch.long, device=kv.device)
        send = _rows(pool.index_select(2, idx).movedim(2, 0))
        comm.all_to_all(send, [0] * world, sizes)
        return send.numel()
    got = comm.all_to_all(
        torch.empty(0, width, dtype=torch.uint8, device=kv.device),
        [sizes[rank]] + [0] * (world - 1),
        [0] * world,
    )
    idx = torch.tensor(ship[rank], dtype=torch.long, device=kv.device)
    blocks = got.to(kv.device).view(kv.dtype).view(len(ship[rank]), *pool.shape[:2], *pool.shape[3:])
    pool.index_copy_(2, idx, blocks.movedim(0, 2))
    return 0


def mirror(comm, kv: torch.Tensor, shares: list[StepShare]) -> int:
    """Every rank but 0 sends rank 0 the KV rows (every layer) of the slots its share wrote; rank 0
    writes them into its pool. Returns the bytes this rank sent (rank 0: received)."""
    sizes = [s.meta.slot_mapping.numel() for s in shares]
    world, rank = comm.world, comm.rank
    if not any(sizes[1:]):
        return 0
    width = kv[:, :, :1].numel() * kv.element_size()
    if rank:
        slots = shares[rank].meta.slot_mapping.to(kv.device)
        send = _rows(kv.index_select(2, slots).movedim(2, 0))
        comm.all_to_all(send, [0] * world, [sizes[rank]] + [0] * (world - 1))
        return send.numel()
    got = comm.all_to_all(
        torch.empty(0, width, dtype=torch.uint8, device=kv.device), [0] + sizes[1:], [0] * world
    )
    slots = torch.cat([s.meta.slot_mapping for s in shares[1:]]).to(kv.device)
    rows = got.to(kv.device).view(kv.dtype).view(slots.numel(), kv.shape[0], kv.shape[1], *kv.shape[3:])
    kv.index_copy_(2, slots, rows.movedim(0, 2))
    return got.numel()
