"""Two prefill workers share the prompts end to end: a router, two prefill and one decode worker
processes on loopback, twelve concurrent uncached prompts through the official openai client.
Each prefill worker computes a fair share of them, judged from its own
`prefill_tokens_computed` counter (never from timing). And a prefill worker killed mid-transfer is
the one the router counts the failure against, not the decode worker that recovered."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.server.openai_api import PREFILL_HEADER

MODEL = "tiny-qwen2"
N, PROMPT = 12, 330
pytestmark = pytest.mark.slow


def _workers(url: str) -> list[dict]:
    return httpx.get(url + "/admin/workers", timeout=10).json()["workers"]


def _computed(worker_url: str) -> int:
    return int(httpx.get(worker_url + "/health", timeout=10).json()["prefill_tokens_computed"])


def _prompt(i: int) -> list[int]:
    return [(7919 * i + 31 * j) % 30000 + 100 for j in range(PROMPT)]  # no two share a block


def test_two_prefill_workers_share_concurrent_uncached_prompts(tmp_path):
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--model", MODEL, "--prefill", "2", "--decode", "1", "--port", str(port)]
    with ServerProcess(cmd, port, tmp_path / "pd.log") as srv:
        srv.wait_ready(timeout=300)
        prefill = [w for w in _workers(srv.url) if w["role"] == "prefill"]
        assert len(prefill) == 2
        before = {w["id"]: _computed(w["url"]) for w in prefill}
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(i: int) -> int:
            r = client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=4, temperature=0)
            return r.usage.prompt_tokens

        with ThreadPoolExecutor(N) as pool:
            assert list(pool.map(ask, range(N))) == [PROMPT] * N
        share = {w["id"]: _computed(w["url"]) - before[w["id"]] for w in prefill}
        total = sum(share.values())
        # Every prompt is long and uncached, so the prefill pool computes (nearly) all of them...
        assert total >= N * PROMPT // 2, share
        # ...and neither prefill worker is left idle: each computes at least a quarter.
        assert all(n >= total // 4 for n in share.values()), share
        # The router's own figures come back to zero once every request is done.
        deadline = time.monotonic() + 30
        while any(
            w["load"]["in_flight"] or w["load"]["queued_prefill_tokens"] or w["load"]["decode_tokens"]
            for w in _workers(srv.url)
        ):
            assert time.monotonic() < deadline, _workers(srv.url)
            time.sleep(0.2)
        assert all(
            w["requests"] >= 1 and w["errors"] == 0 and w["breaker"] == "closed"
            for w in _workers(srv.url)
            if w["role"] == "prefill"
        ), _workers(srv.url)

        # What the router reads: the decode worker's first line names the prefill worker it used.
        decode = next(w for w in _workers(srv.url) if w["role"] == "decode")
        body = {"request_id": "direct-0", "prompt_token_ids": _prompt(N), "sampling": {"max_tokens": 2}}
        with httpx.stream(
            "POST",
            decode["url"] + "/internal/generate",
            json=body,
            timeout=120,
            headers={PREFILL_HEADER: prefill[1]["kv_endpoint"]},
        ) as resp:
            assert resp.status_code == 200
            first = json.loads(next(line for line in resp.iter_lines() if line))
        assert first["prefilled_by"] == prefill[1]["kv_endpoint"] and first["prefill_failed"] == [], first


def test_a_prefill_worker_killed_mid_transfer_is_the_one_counted_as_failed(tmp_path):
    config = tmp_path / "deploy.yaml"
    # A bandwidth limit keeps the prompt's KV in flight for seconds, so the kill lands mid-transfer.
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": MODEL},
                "cache": {"block_size": 16, "device_blocks": 128},
                "transfer": {"backend": "shm", "bandwidth_limit": 40000},
                "disagg": {"local_prefill_max_tokens": 16, "transfer_timeout_s": 20},
            }
        )
    )
    port = free_port()
    with ServerProcess(
        pdserve_cmd() + ["serve", "--config", str(config), "--port", str(port)], port, tmp_path / "pd.log"
    ) as srv:
        srv.wait_ready(timeout=300)
        workers = {w["role"]: w for w in _workers(srv.url)}
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(
                client.completions.create,
                model=MODEL,
                prompt=[(5 * j) % 250 + 1 for j in range(600)],
                max_tokens=4,
                temperature=0,
            )
            deadline = time.monotonic() + 60
            while not httpx.get(workers["decode"]["url"] + "/health").json()["kv_transfers_transferring"]:
                assert time.monotonic() < deadline and not reply.done(), "the transfer never started"
                time.sleep(0.05)
            os.kill(workers["prefill"]["pid"], signal.SIGKILL)
            assert reply.result().usage.prompt_tokens == 600  # the decode worker prefilled it itself
        after = {w["role"]: w for w in _workers(srv.url)}
        assert after["prefill"]["errors"] == 1 and after["decode"]["errors"] == 0, after
        assert after["decode"]["breaker"] == "closed"
