"""A PD deployment whose workers publish KV events in vLLM's format (cache.kv_events_format: vllm):
the router's index follows both workers, and what it holds for each is exactly what a reader of the
worker's replay socket reconstructs from vLLM's batches (AllBlocksCleared first, then the stored and
removed blocks with their tokens)."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.cache.kv_events_vllm import AllBlocksCleared, BlockStored, VLLMEventSubscriber, decode_batch

MODEL = "tiny-qwen2"
pytestmark = pytest.mark.slow


def _replayed_blocks(health: dict) -> tuple[set[str], list]:
    sub = VLLMEventSubscriber(health["kv_events_endpoint"], health["kv_events_replay_endpoint"], "probe")
    try:
        batches = [decode_batch(p) for _, p in sub.replay(0)]
    finally:
        sub.close()
    events = [ev for b in batches for ev in b.events]
    held: set[str] = set()
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            held.clear()
        elif ev.medium == "GPU":
            (held.update if isinstance(ev, BlockStored) else held.difference_update)(
                h.hex() for h in ev.block_hashes
            )
    return held, events


def test_router_index_follows_vllm_format_workers(tmp_path):
    (tmp_path / "c.yaml").write_text(
        f"model: {{name: {MODEL}}}\ncache: {{kv_events_format: vllm, block_size: 4}}\n"
        "disagg: {local_prefill_max_tokens: 8}\n"
    )
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--config", str(tmp_path / "c.yaml"), "--prefill", "1", "--decode", "1"]
    with ServerProcess(cmd + ["--port", str(port)], port, tmp_path / "log") as srv:
        srv.wait_ready(timeout=300)
        for i in range(4):
            r = httpx.post(
                srv.url + "/v1/completions",
                json={"model": MODEL, "prompt": "tell me a story " * 6 + str(i), "max_tokens": 3},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        workers = httpx.get(srv.url + "/admin/workers", timeout=10).json()["workers"]
        assert {w["role"] for w in workers} == {"prefill", "decode"}
        deadline = time.monotonic() + 30
        for w in workers:
            health = httpx.get(w["url"] + "/health", timeout=10).json()
            assert health["kv_events_format"] == "vllm" and health["kv_events_snapshot_endpoint"] is None
            assert health["kv_events_topic"] == f"kv@{w['url'].split('//')[1]}@{MODEL}"
            held, events = _replayed_blocks(health)
            assert isinstance(events[0], AllBlocksCleared) and held, w["role"]
            assert all(
                len(ev.token_ids) == 4 * len(ev.block_hashes) for ev in events if isinstance(ev, BlockStored)
            )
            while True:  # the router's index catches up with the events
                rows = httpx.get(srv.url + "/admin/workers", timeout=10).json()["workers"]
                indexed = next(r["kv_index_blocks"] for r in rows if r["id"] == w["id"])
                if indexed == len(held):
                    break
                assert time.monotonic() < deadline, (w["role"], indexed, len(held))
                time.sleep(0.2)
