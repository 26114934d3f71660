"""Expert-balancer metrics: per-rank load, imbalance, experts moved; Prometheus gauges.

The helpers are pure functions of tensors so the trigger, the benchmark and tests share them.
"""

from __future__ import annotations

import torch


def replica_counts(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """`[layers, num_logical]` number of physical slots holding each logical expert."""
    phy2log = torch.as_tensor(phy2log, dtype=torch.long)
    if phy2log.dim() == 1:
        phy2log = phy2log.unsqueeze(0)
    cnt = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.long)
    return cnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def rank_load(load, phy2log, num_ranks: int) -> torch.Tensor:
    """`[layers, num_ranks]` load each rank serves, with tokens split evenly over replicas.

    Even splitting is what `dispatch.dispatch` does, so this is the load the ranks will see.
    """
    load = torch.as_tensor(load, dtype=torch.float64)
    phy2log = torch.as_tensor(phy2log, dtype=torch.long)
    if load.dim() == 1:
        load, phy2log = load.unsqueeze(0), phy2log.reshape(1, -1)
    layers, P = phy2log.shape
    cnt = replica_counts(phy2log, load.shape[1]).clamp(min=1).to(torch.float64)
    per_slot = torch.gather(load / cnt, 1, phy2log)  # [layers, P]
    rank_of = slot_ranks(P, num_ranks)
    out = torch.zeros(layers, num_ranks, dtype=torch.float64)
    return out.index_add_(1, rank_of, per_slot)


def imbalance(rank_loads) -> float:
    """max/mean rank load of a forward pass: sum over layers of the slowest rank / of the mean.

    Each MoE layer waits for its most-loaded rank, so summing per-layer maxima gives the
    slowdown of a whole pass against a perfectly balanced one (1.0).
    """
    rl = torch.as_tensor(rank_loads, dtype=torch.float64)
    if rl.dim() == 1:
        rl = rl.unsqueeze(0)
    mean = rl.mean(dim=1).sum().item()
    return rl.amax(dim=1).sum().item() / mean if mean > 0 else 1.0


def experts_moved(old, new, num_ranks: int) -> int:
    """Expert weights a placement change must copy: replicas a rank gains, over all layers.

    Counted per rank as a multiset difference, so reordering slots inside a rank is free.
    """
    old = torch.as_tensor(old, dtype=torch.long)
    new = torch.as_tensor(new, dtype=torch.long)
    if old.shape != new.shape:
        raise ValueError(f"placements differ in shape: {tuple(old.shape)} vs {tuple(new.shape)}")
    if old.dim() == 1:
        old, new = old.unsqueeze(0), new.unsqueeze(0)
    P = old.shape[1]
    E = int(max(old.max().item(), new.max().item())) + 1 if old.numel() else 1
    moved = 0
    for r in range(num_ranks):
        s = _slots(r, P, num_ranks)
        a = replica_counts(old[:, s], E)
        b = replica_counts(new[:, s], E)
        moved += int((b - a).clamp(min=0).sum().item())
    return moved


def slot_ranks(num_physical: int, num_ranks: int) -> torch.Tensor:
    """`[num_physical]` rank owning each slot: rank r owns slots r*P//R .. (r+1)*P//R."""
    P, R = num_physical, num_ranks
    return torch.tensor([r for r in range(R) for _ in range(r * P // R, (r + 1) * P // R)], dtype=torch.long)


def _slots(r: int, P: int, R: int) -> slice:
    return slice(r * P // R, (r + 1) * P // R)


class BalancerMetrics:
    """Prometheus gauges for the balancer, registered on a caller-supplied registry.

    The caller times the rebalance (the policy itself stays pure) and reports it here.
    """

    def __init__(self, registry, prefix: str = "pdserve_eplb"):
        from prometheus_client import Counter, Gauge

        self.rank_load = Gauge(
            f"{prefix}_rank_load", "Load served by an EP rank (tokens, window)", ["rank"], registry=registry
        )
        self.imbalance = Gauge(
            f"{prefix}_imbalance", "max/mean rank load of the placement in force", registry=registry
        )
        self.imbalance_before = Gauge(
            f"{prefix}_imbalance_before",
            "max/mean rank load just before the last rebalance",
            registry=registry,
        )
        self.imbalance_after = Gauge(
            f"{prefix}_imbalance_after",
            "max/mean rank load predicted after the last rebalance",
            registry=registry,
        )
        self.moved_last = Gauge(
            f"{prefix}_experts_moved_last", "Expert replicas copied by the last rebalance", registry=registry
        )
        self.moved = Counter(
            f"{prefix}_experts_moved", "Expert replicas copied by rebalances", registry=registry
        )
        self.rebalances = Counter(f"{prefix}_rebalances", "Rebalances done", registry=registry)
        self.seconds = Gauge(
            f"{prefix}_rebalance_seconds", "Wall time of the last rebalance", registry=registry
        )

    def set_rank_load(self, rank_loads) -> None:
        rl = torch.as_tensor(rank_loads, dtype=torch.float64)
        per_rank = rl.sum(dim=0) if rl.dim() == 2 else rl
        for r, v in enumerate(per_rank.tolist()):
            self.rank_load.labels(rank=str(r)).set(v)
        self.imbalance.set(imbalance(rl))

    def observe_rebalance(self, before: float, after: float, moved: int, seconds: float) -> None:
        self.imbalance_before.set(before)
        self.imbalance_after.set(after)
        self.moved_last.set(moved)
        self.moved.inc(moved)
        self.rebalances.inc()
        self.seconds.set(seconds)


class EPTrafficCollector:
    """`pdserve_ep_bytes_total{kind}` and `pdserve_ep_steps_total` of an expert-parallel worker, read
    at scrape time from `read()` (ExpertParallelModel.traffic)."""

    def __init__(self, read) -> None:
        self._read = read

    def describe(self):
        return []  # registering must not trigger a collect

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        t = dict(self._read())
        steps = t.pop("steps", 0)
        fam = CounterMetricFamily(
            "pdserve_ep_bytes",
            "Bytes between rank 0 and the other expert-parallel ranks, by kind (dispatch, combine, "
            "kv_shipped, experts: sent by rank 0; kv_mirrored, logits (the final rows rank 0 computes "
            "the logits from): received by it)",
            labels=["kind"],
        )
        for kind, v in t.items():
            fam.add_metric([kind], v)
        yield fam
        yield CounterMetricFamily("pdserve_ep_steps", "Steps run by the expert-parallel ranks", value=steps)
