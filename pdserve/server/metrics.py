"""Prometheus metrics of a serving process (names prefixed `pdserve_`)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.protocol.stats import STATS
from pdserve.server.vllm_metrics import VLLMMetrics

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
    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        vllm_names: tuple[str, int] | None = None,
    ) -> None:
        """`vllm_names`: (served model name, context length) to export vLLM's names too (a worker's
        server.vllm_metrics; server/vllm_metrics.py), fed by the same observations as these."""
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
        self.vllm: VLLMMetrics | None = None
        if vllm_names is not None:
            self.vllm = VLLMMetrics(r, stats, *vllm_names)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request timestamps, fed on the engine thread as outputs arrive. Each observation goes to
    pdserve's family and, when exported, to vLLM's of the same meaning, with the same value."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.max_tokens: dict[str, int] = {}

    def start(self, request_id: str, t: float, max_tokens: int | None = None) -> None:
        self.arrival[request_id] = t
        if max_tokens is not None and self.metrics.vllm is not None:
            self.max_tokens[request_id] = max_tokens

    def forget(self, request_id: str) -> None:
        for table in (self.arrival, self.first, self.last, self.max_tokens):
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
        m, v = self.metrics, self.metrics.vllm
        if out.new_token_ids:
            n = len(out.new_token_ids)
            m.generation_tokens.inc(n)
            if v is not None:
                v.generation_tokens.inc(n)
            if rid not in self.first:
                self.first[rid] = t
                m.ttft.observe(t - arrival)
                if v is not None:
                    v.ttft.observe(t - arrival)
            else:
                gap = t - self.last[rid]
                m.itl.observe(gap)
                if v is not None:
                    v.itl.observe(gap)
                    v.itl_legacy.observe(gap)
            self.last[rid] = t
        if out.finished:
            m.e2e.observe(t - arrival)
            m.prompt_tokens.inc(out.num_prompt_tokens)
            m.requests.labels(out.finish_reason or "unknown").inc()
            first = self.first.pop(rid, None)
            tpot = None
            if first is not None and out.num_output_tokens > 1:
                tpot = (t - first) / (out.num_output_tokens - 1)
                m.tpot.observe(tpot)
            last = self.last.pop(rid, None)
            if v is not None:
                self._finish_vllm(v, out, t, arrival, first, last, tpot)
            self.arrival.pop(rid, None)
            self.max_tokens.pop(rid, None)

    def _finish_vllm(self, v, out, t: float, arrival: float, first, last, tpot) -> None:
        v.e2e.observe(t - arrival)
        v.prompt_tokens.inc(out.num_prompt_tokens)
        v.request_prompt_tokens.observe(out.num_prompt_tokens)
        v.request_generation_tokens.observe(out.num_output_tokens)
        v.finished(out.finish_reason or "unknown")
        max_tokens = self.max_tokens.get(out.request_id)
        if max_tokens is not None:
            v.request_max_tokens.observe(max_tokens)
        if tpot is not None:
            v.tpot.observe(tpot)
        # The engine's first scheduling of the request splits waiting from running (same clock).
        scheduled = getattr(out, "scheduled_time", None)
        if scheduled is None:
            return
        v.queue.observe(max(0.0, scheduled - arrival))
        if first is not None:
            v.prefill.observe(max(0.0, first - scheduled))
            v.decode.observe(max(0.0, (last or first) - first))
            v.inference.observe(max(0.0, (last or first) - scheduled))
