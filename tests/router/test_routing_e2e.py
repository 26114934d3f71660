"""Routing end to end on loopback: cache-aware placement from the workers' KV events, and a
decode worker killed mid-stream whose stream the router migrates to another one."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from pdserve import SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

pytestmark = pytest.mark.slow


def _workers(url: str) -> list[dict]:
    return httpx.get(url + "/admin/workers").json()["workers"]


def _requests_by_worker(url: str) -> dict[str, int]:
    return {w["id"]: w["requests"] for w in _workers(url)}


def _served_by(url: str, before: dict[str, int], role: str) -> list[str]:
    after = {w["id"]: (w["requests"], w["role"]) for w in _workers(url)}
    return [wid for wid, (n, r) in after.items() if r == role and n > before.get(wid, 0)]


def test_follow_up_goes_to_the_decode_worker_holding_its_prefix(tmp_path):
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--model",
        "tiny-qwen2",
        "--prefill",
        "2",
        "--decode",
        "2",
        "--port",
        str(port),
    ]
    with ServerProcess(cmd, port, tmp_path / "pd.log") as srv:
        srv.wait_ready(timeout=180)
        prefixes = [[(97 * i + 13 * j) % 40000 + 100 for j in range(192)] for i in range(4)]
        placed = {}
        for i, p in enumerate(prefixes):
            before = _requests_by_worker(srv.url)
            r = httpx.post(
                srv.url + "/v1/completions", json={"model": "tiny-qwen2", "prompt": p, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            [placed[i]] = _served_by(srv.url, before, "decode")
        deadline = time.monotonic() + 20  # the router's index learns of the blocks from KV events
        while not all(w["kv_index_blocks"] >= 12 for w in _workers(srv.url) if w["id"] in placed.values()):
            assert time.monotonic() < deadline, _workers(srv.url)
            time.sleep(0.2)
        for i, p in enumerate(prefixes):
            before = _requests_by_worker(srv.url)
            r = httpx.post(
                srv.url + "/v1/completions",
                json={"model": "tiny-qwen2", "prompt": p + [7, 8, 9, 10], "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
            assert _served_by(srv.url, before, "decode") == [placed[i]], (i, placed)
        # A drained worker gets no new requests, even the ones its cache would attract.
        drained = placed[0]
        assert httpx.post(f"{srv.url}/admin/workers/{drained}/drain").json()["draining"] is True
        before = _requests_by_worker(srv.url)
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "tiny-qwen2", "prompt": prefixes[0] + [11, 12], "max_tokens": 2},
        )
        assert r.status_code == 200
        [other] = _served_by(srv.url, before, "decode")
        assert other != drained


def _stream_and_kill(url: str, prompt: str, params: dict, kill_at: int) -> tuple[str, str]:
    """Stream a completion; after `kill_at` chunks, SIGKILL the decode worker serving it."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="smollm2-135m", prompt=prompt, stream=True, extra_body={"ignore_eos": True}, **params
    )
    text, chunks, killed = [], 0, None
    for chunk in stream:
        text.append(chunk.choices[0].text)
        chunks += 1
        if chunks == kill_at:
            [victim] = [w for w in _workers(url) if w["role"] == "decode" and w["load"]["in_flight"]]
            os.kill(victim["pid"], signal.SIGKILL)
            killed = victim["id"]
    assert killed is not None
    return "".join(text), killed


def test_killed_decode_worker_mid_stream_is_migrated(tmp_path, smollm_llm):
    prompt = "Write a long story about a lighthouse keeper and a storm. Chapter one:"
    greedy = {"temperature": 0, "max_tokens": 100}
    # Seeded sampling with penalties: the new worker must go on with the same draws and counts.
    seeded = {"temperature": 0.8, "top_p": 0.95, "seed": 7, "presence_penalty": 0.4, "max_tokens": 80}
    want = {
        name: smollm_llm.generate(prompt, SamplingParams(ignore_eos=True, **p))[0].text
        for name, p in (("greedy", greedy), ("seeded", seeded))
    }
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--model",
        "smollm2-135m",
        "--prefill",
        "1",
        "--decode",
        "3",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--quantization",  # float32 like smollm_llm, the offline engine it is compared with
        "none",
    ]
    with ServerProcess(cmd, port, tmp_path / "pd.log") as srv:
        srv.wait_ready(timeout=300)
        for name, params in (("greedy", greedy), ("seeded", seeded)):
            text, killed = _stream_and_kill(srv.url, prompt, params, kill_at=30)
            assert text == want[name], name
            migrated = {w["id"]: w["migrations"] for w in _workers(srv.url)}
            assert migrated[killed] == 1
