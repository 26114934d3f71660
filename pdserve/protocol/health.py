"""A worker's `GET /health` body (200): who it is, where its KV planes listen, and its engine's stats.

The worker builds one `WorkerHealth` and sends `to_wire()`; the router keeps `WorkerHealth.from_wire`
of what it read and routes by its fields. The body is flat JSON: the fields below, then every other
key of `LLMEngine.stats()` (declared, with its metric kind, in protocol/stats.py). Every field has a
default, so a worker that reports less (an older one, a test's stand-in) is still read.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class WorkerHealth(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: str = "ok"
    role: str | None = None
    pid: int | None = None
    worker_id: str | None = None  # the worker's own name (KV events use it)
    model: str | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    kv_endpoint: str | None = None  # its PD control/KV socket (prefill workers)
    kv_events_endpoint: str | None = None
    kv_events_snapshot_endpoint: str | None = None
    # pdserve, or vllm / vllm-array (cache/kv_events_vllm.py: no snapshots, a replay socket instead).
    kv_events_format: str = "pdserve"
    kv_events_replay_endpoint: str | None = None
    # Its version label (pdserve/version.py): what `pdserve rollout` replaces and canaries route by.
    pdserve_version: str | None = None
    config_digest: str | None = None
    # The engine stats the router routes by and sums over its fleet (router/gateway.py).
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prefix_cache_blocks: int = 0
    prefill_tokens_computed: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    def stat(self, key: str) -> float:
        """A numeric stat by key, a field or one of the extra engine stats (0 when absent)."""
        value = (
            getattr(self, key, None) if key in type(self).model_fields else (self.model_extra or {}).get(key)
        )
        return float(value) if isinstance(value, (int, float)) else 0.0

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_wire(cls, body: Any) -> WorkerHealth:
        """Raises ValueError (pydantic's ValidationError is one) for a body that is not a health report."""
        return cls.model_validate(body)
