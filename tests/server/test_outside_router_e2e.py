"""Workers serving an outside router (a gateway's endpoint picker, as llm-d runs one): a decode worker
takes `/v1` calls with a worker API key and llm-d's prefill header (x-prefiller-host-port: the
prefill worker's HTTP host:port), pulls the prompt's KV from that prefill worker and answers the
greedy tokens pdserve's own router gets; the key reaches nothing internal; a bad header value falls
back to what the worker does with no header (its own prefill, or a prefill worker it knows)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.server.prefiller import parse_host_port

MODEL = "tiny-qwen2"
TOKEN = "internal-secret-5e1"
OUTSIDE = "sk-gateway-81c2"
pytestmark = pytest.mark.slow


def _start(tmp: Path, name: str, args: list[str], cfg: dict) -> ServerProcess:
    port = free_port()
    path = tmp / f"{name}.yaml"
    base = {
        "model": {"name": MODEL},
        "cache": {"block_size": 4, "device_blocks": 128},
        "scheduler": {"max_num_batched_tokens": 64},
        "disagg": {"local_prefill_max_tokens": 8},
    }
    path.write_text(yaml.safe_dump({**base, **cfg}))
    return ServerProcess(
        pdserve_cmd() + args + ["--config", str(path), "--port", str(port)], port, tmp / name
    )


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outside")
    prefill = _start(tmp, "prefill", ["worker", "--role", "prefill"], {"server": {"internal_token": TOKEN}})
    decode = _start(
        tmp,
        "decode",
        ["worker", "--role", "decode"],
        {"server": {"internal_token": TOKEN, "worker_api_keys": [OUTSIDE]}},
    )
    procs = [prefill, decode]
    try:
        prefill.wait_ready(timeout=180)
        decode.wait_ready(timeout=180)
        router = _start(
            tmp,
            "router",
            ["router", "--worker", f"prefill={prefill.url}", "--worker", f"decode={decode.url}"],
            {"server": {"internal_token": TOKEN}},
        )
        procs.append(router)
        router.wait_ready(timeout=180)
        yield prefill, decode, router
    finally:
        for p in procs:
            p.stop()


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(11 * seed + 7 * j) % 250 + 1 for j in range(n)]


def _complete(url: str, prompt: list[int], headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8, "logprobs": 0},
        headers=headers or {},
        timeout=120,
    )


def _tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _computed(srv: ServerProcess) -> int:
    return httpx.get(srv.url + "/health", timeout=10).json()["prefill_tokens_computed"]


def _outside(prefiller: str | None = None) -> dict:
    h = {"Authorization": f"Bearer {OUTSIDE}"}
    if prefiller is not None:
        h["x-prefiller-host-port"] = prefiller
    return h


def test_llmd_prefill_header_pulls_kv_from_that_prefill_worker(deployment):
    prefill, decode, router = deployment
    host_port = prefill.url.removeprefix("http://")
    prompt = _prompt(1)
    p0, d0 = _computed(prefill), _computed(decode)
    direct = _tokens(_complete(decode.url, prompt, _outside(host_port)))
    # The prompt was computed on the prefill worker, not here (the decode worker computes no prompt token).
    assert _computed(prefill) - p0 == len(prompt)
    assert _computed(decode) == d0
    # pdserve's own router, on a prompt neither worker holds yet, and on the same one: the same tokens.
    assert _tokens(_complete(router.url, prompt)) == direct
    other = _prompt(2)
    assert _tokens(_complete(router.url, other)) == _tokens(_complete(decode.url, other, _outside(host_port)))


@pytest.mark.parametrize("value", ["not a host", "http://x/y", "127.0.0.1:1", "", "DECODE"])
def test_bad_prefill_header_falls_back_to_a_local_prefill(deployment, value):
    prefill, decode, router = deployment
    if value == "DECODE":  # a worker that answers but is not a prefill worker
        value = decode.url.removeprefix("http://")
    prompt = _prompt(10 + len(value), 24)
    # As with no header: the decode worker prefills here or on a prefill worker it already knows.
    assert _tokens(_complete(decode.url, prompt, _outside(value))) == _tokens(_complete(router.url, prompt))


def test_the_outside_key_reaches_the_openai_api_only(deployment):
    _, decode, _ = deployment
    ok = _outside()
    assert httpx.get(decode.url + "/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
    r = httpx.post(decode.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=ok)
    assert r.status_code == 200, r.text
    for path, body in [
        ("/internal/generate", {"request_id": "x", "prompt_token_ids": [1, 2], "sampling": {}}),
        ("/internal/role", {"role": "prefill"}),
        ("/internal/shed", {}),
    ]:
        r = httpx.post(decode.url + path, json=body, headers=ok)
        assert r.status_code == 401 and r.json()["error"]["code"] == "internal_token", path
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-pdserve-internal-token": "wrong"}):
        r = _complete(decode.url, _prompt(3), headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # The internal token still reaches everything (pdserve's router).
    assert _complete(decode.url, _prompt(3), {"x-pdserve-internal-token": TOKEN}).status_code == 200


def test_worker_keys_without_an_internal_token_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": MODEL}, "server": {"worker_api_keys": [OUTSIDE]}}))
    env = {k: v for k, v in __import__("os").environ.items() if k != "PDSERVE_INTERNAL_TOKEN"}
    r = subprocess.run(
        pdserve_cmd() + ["worker", "--role", "decode", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2 and "server.worker_api_keys" in r.stderr


def test_parse_host_port():
    assert parse_host_port("10.0.0.5:8000") == ("10.0.0.5", 8000)
    assert parse_host_port("prefill-0.svc:80") == ("prefill-0.svc", 80)
    assert parse_host_port("[::1]:9") == ("[::1]", 9)
    for bad in ["", "host", "host:0", "host:70000", "http://h:1", "a/b:1", "u@h:1", "[zz]:1", " :1"]:
        assert parse_host_port(bad) is None, bad
