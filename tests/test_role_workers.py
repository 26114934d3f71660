"""Per-role settings reach the workers `pdserve serve` launches: real worker processes of a PD
deployment, each asked what it runs with."""

from __future__ import annotations

import os

import httpx
import pytest
from proc_environ import environ

from pdserve.config import load_config
from pdserve.launch import start_workers, wait_healthy

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_role_settings_reach_the_launched_workers(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("""
model: {name: tiny-mixtral}
cache: {block_size: 4, device_blocks: 300}
scheduler: {max_num_seqs: 16}
router: {encoder_workers: 0}
deployment:
  prefill: {instances: 1, expert_parallel: 2, max_num_seqs: 3, device_blocks: 40, threads: 1}
  decode: {instances: 1, max_num_seqs: 5, max_num_batched_tokens: 64, device_memory_gb: 0.001}
""")
    config = load_config(cfg)
    workers = start_workers(config, tmp_path)
    try:
        wait_healthy(workers, timeout=600)
        seen = {}
        for w in workers:
            health = httpx.get(w.url + "/health", timeout=30).json()
            eplb = httpx.get(w.url + "/eplb", timeout=30).json()
            seen[w.role] = (
                health["max_num_seqs"],
                health["kv_blocks_total"],
                eplb["num_ranks"],
                environ(w.proc.pid)["OMP_NUM_THREADS"],
            )
    finally:
        for w in workers:
            w.stop()
        for w in workers:
            w.wait(60)
    assert seen["prefill"] == (3, 40, 2, "1")
    # decode: its own budget (0.001 GB of tiny-mixtral's 2 layers x 2 KV heads x 16 dims, in blocks of 4
    # tokens), not the global 300 blocks; one EP rank (the global expert_parallel)
    max_seqs, blocks, ranks, threads = seen["decode"]
    assert (max_seqs, ranks, threads) == (5, 1, "1") and 0 < blocks != 300
