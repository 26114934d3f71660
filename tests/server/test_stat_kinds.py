"""Every numeric stat a real engine reports (mixed, decode and prefill roles, with swap, host and
disk tiers and KV events) is declared in protocol/stats.py, and /metrics exports it as declared."""

from __future__ import annotations

import pytest
from pd_harness import pd_config

from pdserve.protocol.health import WorkerHealth
from pdserve.protocol.stats import STATS
from pdserve.server.metrics import ServerMetrics
from pdserve.server.roles import build_engine


@pytest.mark.parametrize("role", ["mixed", "decode", "prefill"])
def test_every_engine_stat_is_declared_and_exported_as_declared(role, tmp_path):
    config = pd_config(
        role,
        overrides={
            "cache.host_cache_gb": 0.01,
            "cache.disk_cache_dir": str(tmp_path),
            "cache.disk_cache_gb": 0.01,
            "cache.kv_events_endpoint": "tcp://127.0.0.1:*",
            # a VLM with an encoder pool (nothing is sent to it): its stats too
            "model.name": "tiny-llava",
            "vision.encoder_endpoints": ["tcp://127.0.0.1:9"],
        },
    )
    engine = build_engine(config)
    try:
        stats = engine.stats()
        numeric = {k for k, v in stats.items() if isinstance(v, (int, float))}
        assert numeric - STATS.keys() == set(), "declare these in pdserve/protocol/stats.py"
        assert {k for k in stats if k not in numeric} == {"kv_events_endpoint", "kv_events_snapshot_endpoint"}
        text = ServerMetrics(engine.stats).render().decode()
        for key in numeric:
            spec = STATS[key]
            suffix = "_total" if spec.kind == "counter" else ""
            assert f"# TYPE pdserve_{spec.metric}{suffix} {spec.kind}" in text
            assert f"\npdserve_{spec.metric}{suffix} " in text
        # The /health body round-trips through its type with every stat.
        body = WorkerHealth(role=role, pid=1, worker_id="w", model="m", **stats).to_wire()
        health = WorkerHealth.from_wire(body)
        assert health.kv_blocks_total == stats["kv_blocks_total"] > 0
        assert all(health.stat(k) == float(stats[k]) for k in numeric)
    finally:
        engine.connector.close()
        engine.close()
