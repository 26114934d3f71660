"""The real `pdserve router` process, after start and a request, holds no torch and stays small.

Before the torch-free shared layer (pdserve/common) it imported the engine and the model through
RequestOutput and the tokenizer: ~300 MB resident, and ~275 MB per encoder process."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-qwen2"
RSS_LIMIT_KB = 120 * 1024
pytestmark = pytest.mark.slow


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _libtorch(pid: int) -> list[str]:
    return sorted(
        {
            line.split()[-1]
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "libtorch" in line
        }
    )


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids]


def _start(tmp: Path, name: str, args: list[str]) -> ServerProcess:
    port = free_port()
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": MODEL}, "router": {"encoder_workers": 1}}))
    return ServerProcess(
        pdserve_cmd() + args + ["--config", str(path), "--port", str(port)], port, tmp / f"{name}.log"
    )


def test_router_process_has_no_torch_and_stays_under_120_mb(tmp_path):
    # The tokenizer's on-disk cache is filled here first, as any earlier start fills it: a cold
    # cache makes the router parse the GGUF once (numpy), which is not what this test measures.
    from pdserve.common.tokenizer import load_tokenizer

    load_tokenizer(MODEL)

    with _start(tmp_path, "worker", ["worker", "--role", "mixed"]) as worker:
        worker.wait_ready(timeout=180)
        with _start(tmp_path, "router", ["router", "--worker", f"mixed={worker.url}"]) as router:
            router.wait_ready(timeout=180)
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            # A request through the whole router path: encoder process, routing, detokenizing.
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
            )
            assert out.choices[0].finish_reason in ("stop", "length")
            assert httpx.get(router.url + "/health", timeout=10).status_code == 200

            pid = router.proc.pid
            assert not (libs := _libtorch(pid)), f"the router maps {libs[:3]}"
            rss = _status_kb(pid, "VmRSS")
            assert rss < RSS_LIMIT_KB, f"router resident set {rss} KiB\n{router.log_tail()}"
            # Its encoder process (spawned, tokenizer only) does not load torch either.
            deadline = time.monotonic() + 60
            while not (
                kids := [
                    k
                    for k in _children(pid)
                    if "spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")
                ]
            ):
                assert time.monotonic() < deadline, "no encoder process"
                time.sleep(0.2)
            for k in kids:
                assert not (libs := _libtorch(k)), f"an encoder process maps {libs[:3]}"
