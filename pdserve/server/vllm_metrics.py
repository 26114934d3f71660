"""vLLM's metric names on a worker's /metrics, beside pdserve's own (server.vllm_metrics).

Dashboards, alerts, autoscalers and the Gateway API Inference Extension's endpoint picker are
written against vLLM's names (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, ...), with
the labels `model_name` (the served name) and `engine` (the engine's index: "0", one engine per
worker). Nothing here keeps a count of its own: the histograms and counters are observed by
server/metrics.py's RequestTimer at the moment it observes pdserve's, with the same values, and the
gauges and engine counters are read from the engine's stats at scrape time, as pdserve's are. So
the two families cannot drift apart. The list, with what each is fed from, is in docs/api.md.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("model_name", "engine")
ENGINE = "0"
# The reasons vLLM labels its finished requests with; each series exists from the start, so a
# dashboard's rate over it reads 0 rather than nothing. A reason of pdserve's not among them gets
# its own series when it first occurs.
FINISHED_REASONS = ("stop", "length", "abort", "error")

# Seconds. Fine at the bottom (a TTFT or token gap of a few ms on a small model), long at the top (a
# request queued behind a long prompt on a busy CPU).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TTFT_BUCKETS += (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS += (40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_REQUEST_BUCKETS += (240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (a request's token counts never pass it)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            v = m * scale
            if v > max_model_len:
                return out or [float(max_model_len)]
            out.append(float(v))
        scale *= 10


class VLLMMetrics:
    """The vLLM-named families, registered in the worker's own registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        stats: Callable[[], dict[str, Any]],
        model_name: str,
        max_model_len: int,
    ) -> None:
        self.model_name = model_name
        r, labels = registry, (model_name, ENGINE)

        def hist(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=r).labels(*labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token in seconds", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens", _ITL_BUCKETS)
        # The name vLLM's example dashboard still queries for the same token gaps.
        self.itl_legacy = hist(
            "vllm:time_per_output_token_seconds", "Time between consecutive tokens (older name)", _ITL_BUCKETS
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (output tokens - 1)",
            _ITL_BUCKETS,
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency", _REQUEST_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled (waiting)", _REQUEST_BUCKETS
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds", "First scheduled to last token (running)", _REQUEST_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "First scheduled to first token (prefill)", _REQUEST_BUCKETS
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds", "First token to last token (decode)", _REQUEST_BUCKETS
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Prompt tokens of finished requests", tokens
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Generated tokens of finished requests", tokens
        )
        self.request_max_tokens = hist(
            "vllm:request_max_num_generation_tokens", "max_tokens of finished requests", tokens
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        for reason in FINISHED_REASONS:
            self._success.labels(model_name, ENGINE, reason)
        registry.register(_StatsCollector(stats, model_name))

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, ENGINE, reason).inc()


# engine stat -> (vLLM family, kind, help). Read at scrape time from the dict pdserve's own
# collector reads (protocol/stats.py declares these keys).
_FROM_STATS: dict[str, tuple[str, str, str]] = {
    "running": ("vllm:num_requests_running", "gauge", "Requests in the running batch"),
    "waiting": ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = every block in use)"),
    "prefix_cache_queried_tokens": (
        "vllm:prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_cache_hit_tokens": (
        "vllm:prefix_cache_hits",
        "counter",
        "Prompt tokens found in the prefix cache",
    ),
    "preemptions_total": ("vllm:num_preemptions", "counter", "Requests preempted"),
}


class _StatsCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.stats = stats
        self.labels = [model_name, ENGINE]

    def collect(self):
        s = self.stats()
        for key, (name, kind, doc) in _FROM_STATS.items():
            value = s.get(key)
            value = float(value) if isinstance(value, (int, float)) else 0.0
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = family(name, doc, labels=list(LABELS))
            m.add_metric(self.labels, value)
            yield m
            if key == "kv_usage":
                # The name the inference extension's protocol and older dashboards read.
                g = GaugeMetricFamily("vllm:gpu_cache_usage_perc", doc + " (older name)", labels=list(LABELS))
                g.add_metric(self.labels, value)
                yield g
        # The endpoint picker's LoRA affinity reads this gauge's labels (its value: when it was
        # updated). pdserve serves no adapters: none running or waiting, none loadable.
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(["0", "", ""], time.time())
        yield info
