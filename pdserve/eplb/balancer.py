"""Rank 0's expert balancer: recorder fed by the MoE layers, trigger checked every few steps, policy.

The load is global: each rank counts the routed choices of the tokens it owns (recorder.StepCounts)
and rank 0 records their sum over the ranks (`record_counts`), so the placement stays right when the
ranks see different tokens. Every `interval` steps the balancer measures the
max/mean rank load of the placement in force on the heatmap; when the trigger fires it plans a new
placement (`rebalance_experts`, moving as few experts as it can) and hands it to the weight mover.
"""

from __future__ import annotations

import time

import torch

from pdserve.eplb.metrics import BalancerMetrics, experts_moved, imbalance, rank_load
from pdserve.eplb.policy import rebalance_experts
from pdserve.eplb.recorder import ExpertLoadRecorder
from pdserve.eplb.trigger import ImbalanceTrigger

TRIGGER_WINDOW = 3  # imbalance readings in a row above the threshold before rebalancing
TRIGGER_COOLDOWN = 2  # readings ignored after a rebalance, so the new placement is judged fresh


class ExpertBalancer:
    def __init__(
        self,
        layer_ids: list[int],
        num_experts: int,
        phy2log: torch.Tensor,
        num_ranks: int,
        window: int = 256,
        interval: int = 32,
        threshold: float = 1.2,
        num_nodes: int = 1,
        num_groups: int | None = None,
    ) -> None:
        """`num_nodes`: the hosts the ranks span (node n holds ranks n*R//N .. (n+1)*R//N), so a
        replica's copy stays within a host and group-limited routing (`num_groups` expert groups)
        touches few hosts (policy.py)."""
        self.layer_ids = list(layer_ids)
        self._index = {layer: j for j, layer in enumerate(self.layer_ids)}
        self.recorder = ExpertLoadRecorder(len(self.layer_ids), num_experts, window)
        self.trigger = ImbalanceTrigger(threshold, TRIGGER_WINDOW, TRIGGER_COOLDOWN)
        self.phy2log = phy2log.clone()  # the placement in force
        self.num_ranks, self.interval = num_ranks, interval
        self.num_nodes, self.num_groups = num_nodes, num_groups
        self.steps = 0
        self.last_imbalance = 1.0
        self.rebalances = 0
        self.moved_total = 0
        self.metrics: BalancerMetrics | None = None
        self._planned: tuple[float, float, int, float] | None = None  # before, after, moved, start time

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """The MoE layers' expert_load_hook: `layer` is the model's layer index."""
        self.recorder.record(self._index[layer], topk_ids)

    def record_counts(self, counts: torch.Tensor) -> None:
        """A step's `[moe layers, experts]` counts, summed over the ranks."""
        self.recorder.record_counts(counts)

    def end_step(self) -> torch.Tensor | None:
        """Close a step; a new placement when it is time to rebalance, else None."""
        self.recorder.advance()
        self.steps += 1
        if not self.interval or self.steps % self.interval:
            return None
        heat = self.recorder.heatmap()
        loads = rank_load(heat, self.phy2log, self.num_ranks)
        self.last_imbalance = imbalance(loads)
        if self.metrics is not None:
            self.metrics.set_rank_load(loads)
        if not self.trigger.observe(self.last_imbalance):
            return None
        new = rebalance_experts(
            heat,
            self.phy2log.shape[1],
            self.num_ranks,
            self.num_nodes,
            current=self.phy2log,
            num_groups=self.num_groups,
        )
        return self.plan(new) if not torch.equal(new, self.phy2log) else None

    def plan(self, new: torch.Tensor) -> torch.Tensor:
        """Note a placement about to be prepared (from the policy or forced); returns it."""
        heat = self.recorder.heatmap()
        self._planned = (
            imbalance(rank_load(heat, self.phy2log, self.num_ranks)),
            imbalance(rank_load(heat, new, self.num_ranks)),
            experts_moved(self.phy2log, new, self.num_ranks),
            time.perf_counter(),
        )
        return new

    def committed(self, phy2log: torch.Tensor) -> None:
        """The mover switched every rank to `phy2log`: the rebalance is done."""
        before, after, moved, start = self._planned or (
            self.last_imbalance,
            self.last_imbalance,
            0,
            time.perf_counter(),
        )
        self.phy2log = phy2log.clone()
        self.rebalances += 1
        self.moved_total += moved
        self._planned = None
        if self.metrics is not None:
            self.metrics.observe_rebalance(before, after, moved, time.perf_counter() - start)

    def register_metrics(self, registry) -> None:
        self.metrics = BalancerMetrics(registry)
        self.recorder.register_metrics(registry)

    def to_dict(self) -> dict:
        """The heatmap (counts[moe layer][expert]) and the placement, for GET /eplb."""
        return {
            **self.recorder.to_dict(),
            "layer_ids": self.layer_ids,
            "num_ranks": self.num_ranks,
            "phy2log": self.phy2log.tolist(),
            "imbalance": self.last_imbalance,
            "rebalances": self.rebalances,
            "experts_moved": self.moved_total,
        }
