"""Prometheus metrics of a serving process (names prefixed `pdserve_`)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.protocol.stats import STATS

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class _EngineCollector:
    """Reads the engine's stats at scrape time, so nothing has to push them; each key is exported as
    protocol/stats.py declares it (strings such as the KV event endpoints are for /health only)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        self._undeclared: set[str] = set()

    def collect(self):
        for key, value in self.stats().items():
            if not isinstance(value, (int, float)):
                continue
            spec = STATS.get(key)
            if spec is None:
                if key not in self._undeclared:
                    self._undeclared.add(key)
                    log.warning("engine stat %r has no declaration in protocol/stats.py: not exported", key)
                continue
            family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            m = family(f"pdserve_{spec.metric}", spec.help)
            m.add_metric([], float(value))
            yield m


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive tokens (ITL)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (output tokens - 1)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(
            "pdserve_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            "pdserve_request_errors",
            "Requests answered with an error, by HTTP status",
            ["status"],
            registry=r,
        )
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request timestamps, fed on the engine thread as outputs arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def start(self, request_id: str, t: float) -> None:
        self.arrival[request_id] = t

    def forget(self, request_id: str) -> None:
        for table in (self.arrival, self.first, self.last):
            table.pop(request_id, None)

    def oldest_wait(self, now: float) -> float | None:
        """Seconds the longest-waiting request still without a first token has waited; None if none
        waits (the router's controller reads it: a TTFT in the making is at least this)."""
        waits = [now - t for rid, t in list(self.arrival.items()) if rid not in self.first]
        return max(waits) if waits else None

    def on_output(self, out, t: float) -> None:
        rid = out.request_id
        arrival = self.arrival.get(rid)
        if arrival is None:
            return
        m = self.metrics
        if out.new_token_ids:
            m.generation_tokens.inc(len(out.new_token_ids))
            if rid not in self.first:
                self.first[rid] = t
                m.ttft.observe(t - arrival)
            else:
                m.itl.observe(t - self.last[rid])
            self.last[rid] = t
        if out.finished:
            m.e2e.observe(t - arrival)
            m.prompt_tokens.inc(out.num_prompt_tokens)
            m.requests.labels(out.finish_reason or "unknown").inc()
            first = self.first.pop(rid, None)
            if first is not None and out.num_output_tokens > 1:
                m.tpot.observe((t - first) / (out.num_output_tokens - 1))
            self.arrival.pop(rid, None)
            self.last.pop(rid, None)
