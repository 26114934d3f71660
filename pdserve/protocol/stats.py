"""Every numeric key of `LLMEngine.stats()` (and so of a worker's /health body), with its metric kind.

`/metrics` exports a key only by its declaration here (server/metrics.py): the kind is written down,
never guessed from the name, and a key nobody declared is a bug (tests/server/test_stat_kinds.py
collects the keys the real producers emit). `metric` is the Prometheus family name after `pdserve_`;
a counter's exposition adds `_total`, which is why the `_total` keys drop theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class StatSpec:
    kind: MetricKind
    metric: str
    help: str


STATS: dict[str, StatSpec] = {}


def _declare(kind: MetricKind, *keys: str, help_text: str | None = None, metric: str | None = None) -> None:
    for key in keys:
        name = metric or (key[: -len("_total")] if kind == "counter" and key.endswith("_total") else key)
        STATS[key] = StatSpec(kind, name, help_text or key.replace("_", " "))


def _counters(*keys: str) -> None:
    _declare("counter", *keys)


def _gauges(*keys: str) -> None:
    _declare("gauge", *keys)


# ------------------------------------------------------------------ the engine (engine/engine.py)
_declare("gauge", "running", metric="num_requests_running", help_text="Requests in the running batch")
_declare("gauge", "waiting", metric="num_requests_waiting", help_text="Requests waiting for admission")
_declare("gauge", "kv_usage", metric="kv_cache_usage_ratio", help_text="Fraction of KV blocks in use")
_declare("gauge", "kv_blocks_total", help_text="KV blocks in the pool")
_declare("gauge", "kv_blocks_free", help_text="Free KV blocks (unreferenced cached blocks included)")
_declare("gauge", "prefix_cache_blocks", help_text="Blocks held by the prefix cache")
# The prefix hit rate is prefix_cache_hit_tokens / prefix_cache_queried_tokens.
_declare(
    "counter",
    "prefill_tokens_computed",
    help_text="Prompt tokens run through the model (cache hits excluded)",
)
_declare("counter", "prefix_cache_queried_tokens", help_text="Prompt tokens looked up in the prefix cache")
_declare("counter", "prefix_cache_hit_tokens", help_text="Prompt tokens found in the prefix cache")
_gauges("weight_bytes", "loading")
_counters("preemptions_total", "recomputed_tokens_total")
# Speculative decoding: the acceptance rate is accepted / draft.
_declare("counter", "spec_draft_tokens_total", help_text="Draft tokens proposed and verified")
_declare("counter", "spec_accepted_tokens_total", help_text="Draft tokens accepted")
# A step with any prompt tokens counts as a prefill step; the seconds are engine.step()'s, end to end.
_counters(
    "decode_steps_total", "decode_step_seconds_total", "prefill_steps_total", "prefill_step_seconds_total"
)
_declare(
    "counter",
    "decode_steps_borrowing_total",
    help_text="Decode steps run with threads lent by the deployment's idle workers (utils/core_share.py)",
)
_declare(
    "counter",
    "prefill_steps_borrowing_total",
    help_text="Prefill steps that began with threads lent by the deployment's idle workers (utils/core_share.py)",
)

# ------------------------------------------------------------------ swap space (cache/swap.py)
_counters(
    "swapped_out_total",
    "swapped_in_total",
    "swap_fallbacks_total",
    "swap_discarded_total",
    "swap_out_blocks_total",
    "swap_in_blocks_total",
    "swap_seconds_total",
)
_gauges("swap_used_bytes", "swapped_requests")

# ------------------------------------------------------------------ KV tiers (engine/tier_fetch.py over cache/tiers)
for _tier in ("host", "disk", "remote"):
    _counters(
        *(
            f"tier_{_tier}_{name}_total"
            for name in (
                "hits",
                "misses",
                "corrupt",
                "errors",
                "evictions",
                "bytes_written",
                "bytes_read",
                "load_seconds",
                "reads",
            )
        )
    )
_gauges(
    "tier_host_blocks",
    "tier_host_used_bytes",
    "tier_disk_blocks",
    "tier_disk_used_bytes",
    "tier_pending_blocks",
    "tier_queued_bytes",
    "tier_loading",
)
_counters(
    *(
        f"tier_{name}_total"
        for name in (
            "offloads",
            "write_drops",
            "pending_hits",
            "loads",
            "loads_cancelled",
            "loads_timed_out",
            "blocks_loaded",
            "blocks_failed",
        )
    )
)
_counters(
    "tier_fetch_requests_total",
    "tier_fetch_blocks_total",
    "tier_fetched_tokens_total",
    "tier_fetch_fallbacks_total",
    "tier_fetch_seconds_total",
)

# ------------------------------------------------------------------ KV events (cache/kv_events.py)
# Running counts are counters (exported as pdserve_kv_events_published_total etc.); the queue is a gauge.
_counters("kv_events_published_total", "kv_events_dropped_total", "kv_snapshots_served_total")
_counters("kv_event_replays_served_total")  # vLLM's format (cache/kv_events_vllm.py) replays, no snapshots
_gauges("kv_events_pending")

# ------------------------------------------------------------------ PD: the decode side (disagg/receiver.py)
_counters(
    "kv_transfers_completed_total",
    "kv_transfers_failed_total",
    "kv_transfer_bytes_total",
    "kv_transfer_seconds_total",
    "kv_recv_tcp_bytes_total",
    "kv_local_prefill_fallbacks_total",
    "kv_messages_rejected_total",
    "kv_messages_dropped_total",
)
_gauges(
    "kv_transfers_bootstrapping", "kv_transfers_waiting", "kv_transfers_transferring", "kv_blocks_quarantined"
)
# Long prompts prefilled by a pipeline of prefill workers (disagg/parallel.py): requests, chunks, failures.
_counters(
    "kv_parallel_prefills_total", "kv_parallel_prefill_chunks_total", "kv_parallel_prefills_failed_total"
)

# ------------------------------------------------------------------ PD: the prefill side (disagg/sender.py)
_counters(
    "kv_send_bytes_total",
    "kv_send_seconds_total",
    "kv_send_layers_total",
    "kv_send_layer_lag_seconds_total",
    "kv_send_tail_lag_seconds_total",
    "kv_send_steps_total",
    "kv_prefill_jobs_total",
    "kv_prefill_jobs_failed_total",
    "kv_prefill_jobs_refused_total",
)
_gauges(
    "kv_send_layer_lag_seconds_max",
    "kv_prefill_jobs_active",
    "kv_send_gbps",
    "kv_send_layer_lag_seconds_mean",
)
_declare(
    "gauge",
    "kv_reply_sockets_open",
    help_text="Reply sockets to decode workers held open (bounded; idle and least recent ones closed)",
)

# ------------------------------------------------------------------ images (engine/image_inputs.py, engine/encoder_pool.py)
_declare(
    "counter", "images_encoded_total", help_text="Images whose embeddings this engine computed or received"
)
_declare("counter", "encoder_jobs_total", help_text="Encode jobs sent to encoder workers")
_declare("counter", "encoder_failures_total", help_text="Encode jobs that failed or passed their deadline")
_declare("gauge", "images_pending", help_text="Requests waiting for their images' embeddings")
_declare("gauge", "encoder_images_in_flight", help_text="Images sent to encoder workers and not answered yet")
