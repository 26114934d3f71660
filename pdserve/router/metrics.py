"""Router metrics: per worker requests, errors, retries, migrations and breaker state; routing
decisions by reason; the router's own overhead."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from pdserve.router.version_stats import VersionStats

_BREAKER = {"closed": 0, "half_open": 1, "open": 2}


class _WorkerCollector:
    def __init__(self, registry_of_workers) -> None:
        self.workers = registry_of_workers

    def collect(self):
        up = GaugeMetricFamily(
            "pdserve_router_worker_healthy",
            "1 when the worker passes health checks",
            labels=["worker", "role"],
        )
        br = GaugeMetricFamily(
            "pdserve_router_worker_breaker_state", "0 closed, 1 half-open, 2 open", labels=["worker"]
        )
        inflight = GaugeMetricFamily(
            "pdserve_router_worker_in_flight", "Requests outstanding at the worker", labels=["worker"]
        )
        for w in list(self.workers.workers.values()):
            up.add_metric([w.worker_id, w.role], 1.0 if w.healthy else 0.0)
            br.add_metric([w.worker_id], _BREAKER[w.breaker.state.value])
            inflight.add_metric([w.worker_id], w.in_flight)
        yield up
        yield br
        yield inflight


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, workers) -> None:
        r = registry
        self.requests = Counter(
            "pdserve_router_worker_requests", "Requests sent to a worker", ["worker"], registry=r
        )
        self.errors = Counter(
            "pdserve_router_worker_errors", "Failed requests at a worker", ["worker"], registry=r
        )
        self.retries = Counter(
            "pdserve_router_worker_retries",
            "Requests retried after this worker failed",
            ["worker"],
            registry=r,
        )
        self.migrations = Counter(
            "pdserve_router_worker_migrations",
            "Streams moved off this worker mid-generation",
            ["worker"],
            registry=r,
        )
        self.moved = Counter(
            "pdserve_router_worker_moved",
            "Requests a draining worker handed back to continue elsewhere",
            ["worker"],
            registry=r,
        )
        self.decisions = Counter(
            "pdserve_router_decisions", "Routing decisions by pool and reason", ["pool", "reason"], registry=r
        )
        self.decision_seconds = Histogram(
            "pdserve_router_decision_seconds",
            "Time to pick a worker",
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
            registry=r,
        )
        self.overhead_seconds = Histogram(
            "pdserve_router_overhead_seconds",
            "Router time from request arrival to the first byte sent to a worker",
            buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5),
            registry=r,
        )
        self.rejected = Counter(
            "pdserve_router_rejected", "Requests refused by the router, by status", ["status"], registry=r
        )
        r.register(_WorkerCollector(workers))
        self.versions = VersionStats(r)
