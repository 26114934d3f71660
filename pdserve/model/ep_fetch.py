"""Experts for ranks that hold only their own slots (ranks on other hosts).

Ranks of rank 0's host map one copy of every expert in shared memory: the weight mover builds a new
placement from it. A rank on another host keeps only its slots (its memory is its share, not the
whole model), so when a new placement gives it an expert it does not hold, rank 0 sends it: at the
step that announces the placement, every rank computes the same list of (layer, expert) each such
rank lacks, and one all-to-all carries them from rank 0, each expert as the bytes of its packed
tensors (whatever the format: float tiles, int8, int4 with scales). The mover then builds the
standby buffers from them in the background, as from the shared copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.eplb.placement import slot_range
from pdserve.model.experts import ExpertStack


@dataclass
class Fetched:
    experts: dict[tuple[int, int], tuple[ExpertStack, ExpertStack]] = field(default_factory=dict)
    sent_bytes: int = 0  # rank 0: what it sent


def missing(old: torch.Tensor, new: torch.Tensor, rank: int, world: int) -> list[tuple[int, int]]:
    """(MoE layer, expert) that `new` puts in `rank`'s slots and `old` does not."""
    lo, hi = slot_range(old.shape[1], rank, world)
    out = []
    for j in range(old.shape[0]):
        have = set(old[j, lo:hi].tolist())
        out += [(j, e) for e in sorted(set(new[j, lo:hi].tolist()) - have)]
    return out


def _parts(gate_up: ExpertStack, down: ExpertStack) -> list[torch.Tensor]:
    return [*gate_up.tensors, *down.tensors]


def _row_bytes(gate_up: ExpertStack, down: ExpertStack) -> int:
    return sum(t[0].numel() * t.element_size() for t in _parts(gate_up, down))


def _row(gate_up: ExpertStack, down: ExpertStack, e: int) -> torch.Tensor:
    return torch.cat([t[e].contiguous().view(-1).view(torch.uint8) for t in _parts(gate_up, down)])


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
    local: int,
    store: list | None,
    templates: list[tuple[ExpertStack, ExpertStack]],
) -> Fetched:
    """Every rank calls this at the same point. Ranks `local`.. (without the shared copy) get, from
    rank 0 (`store`: every layer's full stacks), the experts `new` gives them and `old` does not;
    `templates`: this rank's own stacks of each layer (their format). Returns this rank's experts by
    (layer, expert) (none on the other ranks), and on rank 0 the bytes it sent."""
    world, rank = comm.world, comm.rank
    lists = [missing(old, new, r, world) if r >= local else [] for r in range(world)]
    sizes = [len(x) for x in lists]
    if not any(sizes):
        return Fetched()
    width = _row_bytes(*templates[0])
    if rank == 0:
        assert store is not None, "rank 0 holds every expert"
        rows = torch.stack([_row(*store[j], e) for r in range(world) for j, e in lists[r]])
        comm.all_to_all(rows, [0] * world, sizes)
        return Fetched(sent_bytes=rows.numel())
    recv = [sizes[rank]] + [0] * (world - 1)
    got = comm.all_to_all(torch.empty(0, width, dtype=torch.uint8), recv, [0] * world)
    return Fetched({(j, e): _unpack(got[i], *templates[j]) for i, (j, e) in enumerate(lists[rank])})
