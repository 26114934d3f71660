"""Expert-parallel load balancing: heatmap recorder, placement policy, trigger, dispatch."""

from pdserve.eplb.dispatch import dispatch, dispatch_by_load, log2phy
from pdserve.eplb.metrics import (
    BalancerMetrics,
    experts_moved,
    imbalance,
    rank_load,
    replica_counts,
)
from pdserve.eplb.policy import rebalance_experts
from pdserve.eplb.recorder import ExpertLoadRecorder
from pdserve.eplb.trigger import ImbalanceTrigger, sustained

__all__ = [
    "BalancerMetrics",
    "ExpertLoadRecorder",
    "ImbalanceTrigger",
    "dispatch",
    "dispatch_by_load",
    "experts_moved",
    "imbalance",
    "log2phy",
    "rank_load",
    "rebalance_experts",
    "replica_counts",
    "sustained",
]
