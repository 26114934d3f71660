"""Hostile requests against a real PD deployment (`pdserve serve`: a router, a prefill and a decode
worker, each its own process): sampling values that would break a sampler (NaN, 1e-40, inf) get
400s naming the parameter, at the router and at each worker's internal API, and ordinary requests
keep working after each one on every worker; a second request with the id of one a worker is
running gets a 409 and never the first one's tokens."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from api_errors import openai_error

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
TOKEN = "hostile-e2e-internal-token"
ADMIN = "sk-admin-hostile-e2e"
NAN, INF = float("nan"), float("inf")
HOSTILE = [
    ({"temperature": 1e-40}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"top_p": NAN}, "top_p"),
    ({"min_p": NAN}, "min_p"),
    ({"presence_penalty": -INF}, "presence_penalty"),
]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("pd")
    port = free_port()
    cfg = tmp / "pd.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": MODEL}, "router": {"admin_keys": [ADMIN]}}))
    cmd = pdserve_cmd() + [
        "serve",
        "--config",
        str(cfg),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--port",
        str(port),
    ]
    # The router and every worker it starts share the internal token (the workers inherit it).
    with ServerProcess(cmd, port, tmp / "pd.log", env={**os.environ, "PDSERVE_INTERNAL_TOKEN": TOKEN}) as srv:
        srv.wait_ready(timeout=300)
        yield srv


def _post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    # json.dumps writes NaN and Infinity literals, which the servers' JSON parser reads as floats.
    return httpx.post(
        url,
        content=json.dumps(body),
        timeout=120,
        headers={"content-type": "application/json", **(headers or {})},
    )


def _workers(pd) -> dict[str, str]:
    """role -> worker URL."""
    r = httpx.get(pd.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return {w["role"]: w["url"] for w in r.json()["workers"]}


def _health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200, r.text  # a dead engine answers 503
    return r.json()


def _prompt(i: int) -> list[int]:
    # Longer than disagg.local_prefill_max_tokens: the decode worker asks the prefill worker.
    return [(31 * i + 7 * j) % 250 + 1 for j in range(120)]


def _ordinary(pd, i: int) -> str:
    r = _post(
        pd.url + "/v1/completions",
        {"model": MODEL, "prompt": _prompt(i), "temperature": 0, "max_tokens": 6, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    return r.json()["choices"][0]["text"]


def _internal(url: str, body: dict) -> httpx.Response:
    return _post(url + "/internal/generate", body, {"x-pdserve-internal-token": TOKEN})


def _token_lines(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    tokens: list[int] = []
    for line in r.text.splitlines():
        msg = json.loads(line)
        assert "error" not in msg, msg
        tokens.extend(msg["token_ids"])
    return tokens


def test_hostile_sampling_values_get_400s_and_every_worker_keeps_serving(pd):
    workers = _workers(pd)
    assert set(workers) == {"prefill", "decode"}
    jobs = _health(workers["prefill"])["kv_prefill_jobs_total"]
    want = {i: _ordinary(pd, i) for i in range(2)}
    i = 0
    for fields, param in HOSTILE:
        for path, body in (
            ("/v1/completions", {"prompt": _prompt(0), "max_tokens": 4}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
            ),
        ):
            err = openai_error(_post(pd.url + path, {"model": MODEL, **body, **fields}), 400)
            assert err["param"] == param, err
            assert _ordinary(pd, i % 2) == want[i % 2]
            i += 1
        # Past the router, straight at each worker's internal API (what a router sends it).
        for role, url in workers.items():
            r = _internal(
                url,
                {
                    "request_id": f"hostile-{role}-{i}",
                    "prompt_token_ids": _prompt(0),
                    "sampling": {"max_tokens": 4, "detokenize": False, **fields},
                },
            )
            assert openai_error(r, 400)["param"] == param
            assert _health(url)["status"] == "ok"
            assert _ordinary(pd, i % 2) == want[i % 2]
    # The prefill worker did the ordinary requests' prefills all along, and failed none.
    h = _health(workers["prefill"])
    assert h["kv_prefill_jobs_total"] > jobs and h["kv_prefill_jobs_failed_total"] == 0
    for url in workers.values():  # each worker still generates on its own, and holds no block
        r = _internal(
            url,
            {
                "request_id": f"after-{url}",
                "prompt_token_ids": [5, 6, 7],
                "sampling": {"temperature": 0, "max_tokens": 3, "ignore_eos": True, "detokenize": False},
            },
        )
        assert len(_token_lines(r)) == 3
        _wait_idle(url)


def _wait_idle(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        h = _health(url)
        if h["running"] == 0 and h["waiting"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]:
            return
        assert time.monotonic() < deadline, h
        time.sleep(0.2)


def test_a_duplicate_request_id_is_refused_and_never_gets_the_first_ones_tokens(pd):
    decode = _workers(pd)["decode"]
    sampling = {"temperature": 0, "max_tokens": 1900, "ignore_eos": True, "detokenize": False}
    body = {"request_id": "same-id", "prompt_token_ids": [9, 8, 7, 6, 5], "sampling": sampling}
    first: list[int] = []
    started, done = threading.Event(), threading.Event()

    def read_first() -> None:
        with httpx.stream(
            "POST",
            decode + "/internal/generate",
            json=body,
            timeout=300,
            headers={"x-pdserve-internal-token": TOKEN},
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    first.extend(json.loads(line)["token_ids"])
                    started.set()
        done.set()

    t = threading.Thread(target=read_first, daemon=True)
    t.start()
    assert started.wait(120)
    err = openai_error(_internal(decode, body), 409)  # while the first one is generating
    assert err["code"] == "duplicate_request_id" and err["param"] == "request_id"
    t.join(300)
    assert done.is_set() and len(first) == 1900
    # The first caller got exactly its own tokens; the id is free again once it finished.
    assert _token_lines(_internal(decode, body)) == first
    _wait_idle(decode)
