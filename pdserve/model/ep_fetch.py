"""Experts a new placement gives a rank, fetched from the ranks that hold them.

When the ranks span hosts, no host keeps a copy of every expert: each rank holds only its own slots
(its memory is its share, not the whole model). At the step that announces a placement, every rank
computes the same plan (`plan_fetch`): each expert the new placement puts in a rank's slots and the
old one does not comes from a rank whose slots hold it under the old placement, one on the same host
where there is one (loopback instead of the link), else the holder with the fewest experts to send so
far (no one rank sends every move). One all-to-all then carries them, each expert as the bytes of its
packed tensors (whatever the format: float tiles, int8, int4 with scales), read from the sender's
slots in force. The mover builds the standby buffers from them in the background.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.eplb.placement import slot_range
from pdserve.model.experts import ExpertStack


@dataclass
class Fetched:
    experts: dict[tuple[int, int], tuple[ExpertStack, ExpertStack]] = field(default_factory=dict)
    sent_bytes: int = 0  # what this rank sent to the others


def missing(old: torch.Tensor, new: torch.Tensor, rank: int, world: int) -> list[tuple[int, int]]:
    """(MoE layer, expert) that `new` puts in `rank`'s slots and `old` does not."""
    lo, hi = slot_range(old.shape[1], rank, world)
    out = []
    for j in range(old.shape[0]):
        have = set(old[j, lo:hi].tolist())
        out += [(j, e) for e in sorted(set(new[j, lo:hi].tolist()) - have)]
    return out


def plan_fetch(
    old: torch.Tensor, new: torch.Tensor, world: int, per_host: int
) -> list[list[tuple[int, int, int]]]:
    """For each rank, the (MoE layer, expert, source rank) it must fetch to go from `old` to `new`
    ([moe layers, P] each). Ranks r and s share a host when r // per_host == s // per_host. Every
    rank computes the same plan from the same placements (the all-to-all's sizes come from it)."""
    layers, num_physical = old.shape
    ranges = [slot_range(num_physical, r, world) for r in range(world)]
    holders: list[dict[int, list[int]]] = []
    for j in range(layers):
        by_expert: dict[int, list[int]] = {}
        for r, (lo, hi) in enumerate(ranges):
            for e in sorted(set(old[j, lo:hi].tolist())):
                by_expert.setdefault(e, []).append(r)
        holders.append(by_expert)
    sends = [0] * world
    plan: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for d in range(world):
        for j, e in missing(old, new, d, world):
            ranks = holders[j].get(e)
            if not ranks:
                raise ValueError(f"no rank holds expert {e} of MoE layer {j} under the placement in force")
            near = [r for r in ranks if r // per_host == d // per_host]
            src = min(near or ranks, key=lambda r: (sends[r], r))
            sends[src] += 1
            plan[d].append((j, e, src))
    return plan


def _parts(gate_up: ExpertStack, down: ExpertStack) -> list[torch.Tensor]:
    return [*gate_up.tensors, *down.tensors]


def _row_bytes(gate_up: ExpertStack, down: ExpertStack) -> int:
    return sum(t[0].numel() * t.element_size() for t in _parts(gate_up, down))


def _write_row(out: torch.Tensor, gate_up: ExpertStack, down: ExpertStack, e: int) -> None:
    """Slot e's bytes into `out` (one row of the send buffer), part after part, without a copy between."""
    off = 0
    for t in _parts(gate_up, down):
        n = t[0].numel() * t.element_size()
        out[off : off + n].copy_(t[e].contiguous().view(-1).view(torch.uint8))
        off += n


def _unpack(row: torch.Tensor, gate_up: ExpertStack, down: ExpertStack) -> tuple[ExpertStack, ExpertStack]:
    """One expert's stacks (a slot each) from its bytes, laid out as the templates are."""
    out, off = [], 0
    for t in _parts(gate_up, down):
        n = t[0].numel() * t.element_size()
        out.append(row[off : off + n].clone().view(t.dtype).view(1, *t.shape[1:]))
        off += n
    k = len(gate_up.tensors)

    def stack(like: ExpertStack, parts: list[torch.Tensor]) -> ExpertStack:
        return ExpertStack(like.kind, like.shape, tuple(parts), like.native, like.activations)

    return stack(gate_up, out[:k]), stack(down, out[k:])


def fetch_experts(
    comm,
    old: torch.Tensor,
    new: torch.Tensor,
    per_host: int,
    own: list[tuple[ExpertStack, ExpertStack]],
) -> Fetched:
    """Every rank calls this at the same point, with `old` the placement its slots hold now and `own`
    those slots' stacks of each MoE layer (what it sends from; their format is the received ones').
    Returns the experts this rank lacks under `new`, by (layer, expert), one slot each."""
    world, rank = comm.world, comm.rank
    plan = plan_fetch(old, new, world, per_host)
    if not any(plan):
        return Fetched()
    lo, hi = slot_range(old.shape[1], rank, world)
    held = [old[j, lo:hi].tolist() for j in range(old.shape[0])]
    mine_out = [(d, j, e) for d in range(world) for j, e, src in plan[d] if src == rank]
    send = [sum(1 for d, *_ in mine_out if d == r) for r in range(world)]
    device = own[0][0].tensors[0].device
    out = torch.empty(len(mine_out), _row_bytes(*own[0]), dtype=torch.uint8, device=device)
    for i, (_, j, e) in enumerate(mine_out):
        _write_row(out[i], *own[j], held[j].index(e))
    mine = plan[rank]
    recv = [sum(1 for *_, src in mine if src == s) for s in range(world)]
    got = comm.all_to_all(out, recv, send)
    order = [(j, e) for s in range(world) for j, e, src in mine if src == s]  # as all_to_all lays them out
    return Fetched({(j, e): _unpack(got[i], *own[j]) for i, (j, e) in enumerate(order)}, out.numel())
