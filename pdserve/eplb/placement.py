"""Which experts a rank holds in which physical slots of one MoE layer (read by model/moe.py,
replaced whole by eplb/mover.py between steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.eplb.dispatch import log2phy


@dataclass(frozen=True)
class LayerPlacement:
    """What one rank holds of one MoE layer: a snapshot, swapped whole between steps (see eplb/mover.py)."""

    phy2log: torch.Tensor  # [P] logical expert of each physical slot
    table: tuple[torch.Tensor, torch.Tensor]  # log2phy(phy2log): replicas of each expert, counts
    lo: int  # this rank's slots are lo..hi
    hi: int
    gate_up: Any  # model/experts.py's ExpertStack: hi - lo slots of [2I, H]
    down: Any  # hi - lo slots of [H, I]
    identity: bool  # slot == logical expert: no dispatch needed

    @classmethod
    def build(
        cls,
        phy2log: torch.Tensor,
        num_experts: int,
        lo: int,
        hi: int,
        gate_up: Any,
        down: Any,
    ) -> "LayerPlacement":
        phy2log = torch.as_tensor(phy2log, dtype=torch.long).cpu()
        ident = phy2log.numel() == num_experts and bool((phy2log == torch.arange(num_experts)).all())
        return cls(phy2log, log2phy(phy2log, num_experts), lo, hi, gate_up, down, ident)


def slot_range(num_physical: int, rank: int, world: int) -> tuple[int, int]:
    """Rank r owns slots r*P//R .. (r+1)*P//R, as the placement policy assumes."""
    return rank * num_physical // world, (rank + 1) * num_physical // world
