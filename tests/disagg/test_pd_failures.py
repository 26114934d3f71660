"""Dead peers in a real PD deployment: kill -9 a prefill worker (or a decode worker) mid-transfer.

The tiny model keeps it fast; a bandwidth limit keeps a long prompt's KV in flight for seconds,
so the kill lands mid-transfer every time.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import yaml

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-qwen2"  # tiny-llama's greedy output ignores its KV (it repeats the last token)
pytestmark = pytest.mark.slow
PROMPT = [(5 * j) % 250 + 1 for j in range(600)]  # 600 tokens x 512 B of KV, at 40 kB/s: ~8 s in flight


def _config_file(tmp_path) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"name": MODEL},
                "cache": {"block_size": 16, "device_blocks": 128},
                "transfer": {"backend": "shm", "bandwidth_limit": 40000},
                "disagg": {"local_prefill_max_tokens": 16, "transfer_timeout_s": 20},
            }
        )
    )
    return str(path)


def _wait_for(url: str, pred, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health").json()
        if pred(h):
            return h
        assert time.monotonic() < deadline, f"condition not reached: {h}"
        time.sleep(0.05)


def _idle(h: dict) -> bool:
    return h.get("running") == 0 and h.get("loading") == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]


def _post_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            result["status"], result["json"] = r.status_code, r.json()
        except httpx.HTTPError as e:  # the server it talks to was killed
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_kill_prefill_mid_transfer_completes_locally(tmp_path):
    want = LLM(model=MODEL).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[
        0
    ]
    port = free_port()
    with ServerProcess(
        pdserve_cmd() + ["serve", "--config", _config_file(tmp_path), "--port", str(port)],
        port,
        tmp_path / "pd.log",
    ) as srv:
        srv.wait_ready(timeout=120)
        workers = {w["role"]: w for w in httpx.get(srv.url + "/health").json()["workers"]}
        decode = workers["decode"]["url"]
        t, result = _post_in_thread(
            srv.url,
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        _wait_for(decode, lambda h: h["kv_transfers_transferring"] == 1)
        os.kill(workers["prefill"]["pid"], signal.SIGKILL)
        t.join(timeout=60)
        assert result["status"] == 200, result
        assert result["json"]["choices"][0]["text"] == want.text
        h = _wait_for(decode, _idle)
        assert h["kv_transfers_failed_total"] == 1 and h["kv_local_prefill_fallbacks_total"] == 1
        assert h["kv_blocks_quarantined"] == 0


def test_kill_decode_mid_transfer_prefill_drops_its_side(tmp_path):
    cfg = _config_file(tmp_path)
    pport, dport = free_port(), free_port()
    pkv, dkv = free_port(), free_port()
    worker = pdserve_cmd() + ["worker", "--config", cfg]
    with (
        ServerProcess(
            worker + ["--role", "prefill", "--port", str(pport), "--kv-port", str(pkv)],
            pport,
            tmp_path / "prefill.log",
        ) as prefill,
        ServerProcess(
            worker
            + [
                "--role",
                "decode",
                "--port",
                str(dport),
                "--kv-port",
                str(dkv),
                "--prefill-endpoints",
                f"tcp://127.0.0.1:{pkv}",
            ],
            dport,
            tmp_path / "decode.log",
        ) as decode,
    ):
        prefill.wait_ready(timeout=120)
        decode.wait_ready(timeout=120)
        start = httpx.get(prefill.url + "/health").json()
        _post_in_thread(decode.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        _wait_for(prefill.url, lambda h: h["kv_prefill_jobs_active"] == 1)
        decode.kill()
        h = _wait_for(prefill.url, lambda h: h["kv_prefill_jobs_active"] == 0 and _idle(h))
        assert h["kv_prefill_jobs_failed_total"] == start["kv_prefill_jobs_failed_total"] + 1
        assert httpx.get(prefill.url + "/health").status_code == 200  # the prefill worker lives on
