"""Expert activation heatmap: per-layer counts over a sliding window of steps.

The engine calls `record(layer, topk_ids)` from each MoE layer, or `record_counts` with a step's
counts summed over the expert-parallel ranks (`StepCounts`), and `advance()` once per forward step. The window is a ring of per-step buckets plus a running sum, so reading the heatmap costs
one copy, not a sum over the window. A lock keeps a scrape from seeing a half-advanced ring.
"""

from __future__ import annotations

import threading

import torch

from pdserve.eplb.dispatch import own_tokens


class ExpertLoadRecorder:
    def __init__(self, num_layers: int, num_experts: int, window: int = 64):
        if num_layers < 1 or num_experts < 1 or window < 1:
            raise ValueError("num_layers, num_experts and window must be >= 1")
        self.num_layers, self.num_experts, self.window = num_layers, num_experts, window
        self._ring = torch.zeros(window, num_layers, num_experts, dtype=torch.long)
        self._sum = torch.zeros(num_layers, num_experts, dtype=torch.long)
        self._pos = 0  # bucket being filled
        self._steps = 0  # steps completed, saturating at window for reporting
        self._lock = threading.Lock()

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one layer's routed choices (logical expert ids, any shape) in this step."""
        ids = torch.as_tensor(topk_ids).reshape(-1).to(torch.long).cpu()
        if ids.numel() == 0:
            return
        counts = torch.bincount(ids, minlength=self.num_experts)
        if counts.numel() > self.num_experts:
            raise ValueError("expert id out of range")
        with self._lock:
            self._ring[self._pos, layer] += counts
            self._sum[layer] += counts

    def record_counts(self, counts: torch.Tensor) -> None:
        """Add a whole `[layers, experts]` count matrix to this step (e.g. from another rank)."""
        c = torch.as_tensor(counts, dtype=torch.long).cpu()
        if tuple(c.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"counts must be [{self.num_layers}, {self.num_experts}]")
        with self._lock:
            self._ring[self._pos] += c
            self._sum += c

    def advance(self) -> None:
        """Close this step; the oldest step leaves the window."""
        with self._lock:
            self._pos = (self._pos + 1) % self.window
            self._sum -= self._ring[self._pos]
            self._ring[self._pos].zero_()
            self._steps = min(self._steps + 1, self.window)

    def heatmap(self) -> torch.Tensor:
        """`[layers, experts]` activation counts over the window (float, for the policy)."""
        with self._lock:
            return self._sum.to(torch.float64)

    def reset(self) -> None:
        with self._lock:
            self._ring.zero_()
            self._sum.zero_()
            self._pos = self._steps = 0

    def to_dict(self) -> dict:
        """JSON-ready snapshot for an HTTP endpoint."""
        with self._lock:
            counts = self._sum.tolist()
            steps = self._steps
        return {
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "window_steps": self.window,
            "steps_in_window": steps,
            "counts": counts,  # counts[layer][expert]
            "total": [sum(row) for row in counts],
        }

    def register_metrics(self, registry, prefix: str = "pdserve_eplb") -> None:
        """Expose the heatmap as a gauge family read at scrape time (no copies kept up to date)."""
        registry.register(_HeatmapCollector(self, prefix))


class StepCounts:
    """One rank's share of the expert load in the current step: `[moe layers, experts]` counts of the
    routed choices of the tokens this rank owns (`own_tokens`), so the ranks' counts sum to the step's
    load whether they see the same batch (replicated attention) or different ones. The MoE layers feed
    `record`; `take` returns the step's counts and starts the next step."""

    def __init__(self, layer_ids: list[int], num_experts: int, rank: int = 0, world: int = 1) -> None:
        self._index = {layer: j for j, layer in enumerate(layer_ids)}
        self.num_experts, self.rank, self.world = num_experts, rank, world
        # Data-parallel attention: the rank sees only its own tokens, and counts them all.
        self.all_own = False
        self._counts = torch.zeros(len(self._index), num_experts, dtype=torch.long)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """A MoE layer's expert_load_hook: `layer` is the model's layer index, `topk_ids` [tokens, k]."""
        n = topk_ids.shape[0]
        lo, hi = (0, n) if self.all_own else own_tokens(n, self.rank, self.world)
        ids = topk_ids[lo:hi].reshape(-1).to(torch.long).cpu()
        if ids.numel():
            self._counts[self._index[layer]] += torch.bincount(ids, minlength=self.num_experts)

    def take(self) -> torch.Tensor:
        counts, self._counts = self._counts, torch.zeros_like(self._counts)
        return counts


class _HeatmapCollector:
    def __init__(self, recorder: ExpertLoadRecorder, prefix: str):
        self._rec, self._name = recorder, f"{prefix}_expert_activations"

    def describe(self):
        return []  # registering must not trigger a collect; names come from collect()

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        fam = GaugeMetricFamily(
            self._name, "Expert activations in the sliding window", labels=["layer", "expert"]
        )
        for layer, row in enumerate(self._rec.heatmap().tolist()):
            for expert, v in enumerate(row):
                fam.add_metric([str(layer), str(expert)], v)
        yield fam
