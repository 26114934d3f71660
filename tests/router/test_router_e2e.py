"""The router as a real process in front of a real worker process: keys, internal token, rate
limits, the allowlist, the audit log, overload shedding and a fuzzed API that never answers 5xx."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-qwen2"
KEY, OTHER_KEY, ADMIN = "sk-test-7c1d9", "sk-other-42aa", "sk-admin-31f0"
TOKEN = "internal-secret"
pytestmark = pytest.mark.slow


def _start(tmp: Path, name: str, args: list[str], cfg: dict, ready_path: str = "/health") -> ServerProcess:
    port = free_port()
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": MODEL}, **cfg}))
    srv = ServerProcess(
        pdserve_cmd() + args + ["--config", str(path), "--port", str(port)],
        port,
        tmp / f"{name}.log",
        health_path=ready_path,
    )
    return srv


def _wait_listening(srv: ServerProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log_tail()
        try:
            httpx.get(srv.url + "/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("router not listening:\n" + srv.log_tail())


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    srv = _start(tmp, "worker", ["worker", "--role", "mixed"], {"server": {"internal_token": TOKEN}})
    srv.wait_ready(timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def router(tmp_path_factory, worker):
    tmp = tmp_path_factory.mktemp("router")
    srv = _start(
        tmp,
        "router",
        ["router", "--worker", f"mixed={worker.url}"],
        {
            "server": {"internal_token": TOKEN},
            "router": {
                "api_keys": [KEY, OTHER_KEY],
                "admin_keys": [ADMIN],
                "max_concurrent": 1,
                "max_queue": 2,
                "queue_timeout_s": 0.3,
            },
        },
    )
    srv.wait_ready(timeout=120)
    yield srv
    srv.stop()


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_worker_requires_the_internal_token(worker):
    assert httpx.get(worker.url + "/health").status_code == 200
    assert httpx.get(worker.url + "/metrics").status_code == 200  # Prometheus needs no secret
    r = httpx.post(worker.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "internal_token"
    r = httpx.post(
        worker.url + "/internal/generate",
        headers={"x-pdserve-internal-token": "wrong"},
        json={"request_id": "x", "prompt_token_ids": [1, 2], "sampling": {}},
    )
    assert r.status_code == 401


def test_keys_and_parity_through_the_router(router):
    assert httpx.get(router.url + "/health").status_code == 200  # open
    for headers in ({}, _auth("sk-wrong")):
        r = httpx.get(router.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = [(7 * j) % 250 + 1 for j in range(40)]
    got = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    want = LLM(model=MODEL).generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=router.url + "/v1", api_key="nope", max_retries=0).models.list()
    log = router.log_path.read_text()
    assert "key=key-" in log and KEY not in log and OTHER_KEY not in log


def test_logit_bias_reaches_the_worker_through_the_router(router):
    """The official client sends logit_bias as a map of string token ids; the worker samples with it."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0)
    prompt = [(7 * j) % 250 + 1 for j in range(40)]
    got = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=5, logit_bias={"42": 100}
    )
    want = LLM(model=MODEL).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0})
    )[0]
    assert want.token_ids == [42] * 5 and got.choices[0].text == want.text


def test_health_shows_the_workers_to_admin_keys_only(router, worker):
    """Probes get a plain status; the workers' URLs, pids and KV endpoints are for admin keys."""
    for headers in ({}, _auth(), _auth("sk-wrong"), {"x-pdserve-internal-token": TOKEN}):
        r = httpx.get(router.url + "/health", headers=headers)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, headers
        assert worker.url not in r.text
    [w] = httpx.get(router.url + "/health", headers=_auth(ADMIN)).json()["workers"]
    assert w["url"] == worker.url and w["pid"] == worker.proc.pid and w["healthy"]


def test_stop_strings_are_applied_at_the_router(router):
    prompt = [(7 * j) % 250 + 1 for j in range(40)]
    full = httpx.post(
        router.url + "/v1/completions",
        headers=_auth(),
        json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 12},
    ).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = httpx.post(
        router.url + "/v1/completions",
        headers=_auth(),
        json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 12, "stop": [stop]},
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == full[: full.index(stop)]


def test_rate_limit_and_allowlist(tmp_path):
    limited = _start(
        tmp_path, "limited", ["router"], {"router": {"api_keys": [KEY], "requests_per_minute": 3}}
    )
    walled = _start(tmp_path, "walled", ["router"], {"router": {"ip_allowlist": ["10.0.0.0/8"]}})
    with limited, walled:
        _wait_listening(limited)
        _wait_listening(walled)
        codes = [httpx.get(limited.url + "/v1/models", headers=_auth()).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = httpx.get(limited.url + "/v1/models", headers=_auth())
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        r = httpx.get(walled.url + "/v1/models")
        assert r.status_code == 403 and r.json()["error"]["code"] == "ip_not_allowed"


def test_ten_times_capacity_sheds_load_and_stays_flat(router):
    """Capacity is 1 running + 2 queued: 30 at once get answers, each a 200 or a 503, never a crash."""
    body = {"model": MODEL, "prompt": [5] * 20, "max_tokens": 48, "ignore_eos": True}

    def one(_):
        return httpx.post(router.url + "/v1/completions", headers=_auth(), json=body, timeout=60)

    before = _rss_kb(router.proc.pid)
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(30) as pool:
            resps = list(pool.map(one, range(30)))
        codes = {r.status_code for r in resps}
        assert codes <= {200, 503} and 200 in codes and 503 in codes, codes
        assert all(r.headers.get("Retry-After") for r in resps if r.status_code == 503)
    assert router.proc.poll() is None
    assert httpx.get(router.url + "/health").status_code == 200
    assert _rss_kb(router.proc.pid) - before < 60_000  # KiB: no growth with load


_scalars = (
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=True) | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)
_fields = {
    "model": st.sampled_from([MODEL, "other"]) | _json,
    "prompt": st.text(max_size=30) | _json,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "bad"]), "content": st.text(max_size=30) | _json}
        ),
        max_size=3,
    )
    | _json,
    "max_tokens": st.integers(-3, 24) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(-1, 2) | _json,
    "top_k": st.integers(-2, 100) | _json,
    "n": st.integers(-1, 3) | _json,
    "stop": st.lists(st.text(max_size=4), max_size=3) | _json,
    "logprobs": _json,
    "stream": st.booleans(),
    "seed": st.integers(-5, 2**65) | _json,
    "echo": st.booleans() | _json,
}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.fixed_dictionaries({}, optional=_fields),
)
def test_fuzzed_requests_never_get_a_5xx(router, path, body):
    if body.get("max_tokens") is None or not isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = 4  # bound the work of bodies that happen to be valid
    try:
        r = httpx.post(router.url + path, headers=_auth(OTHER_KEY), content=json.dumps(body), timeout=60)
    except ValueError:
        return  # not JSON-encodable (nan): nothing to send
    if r.status_code == 503 and r.json()["error"]["code"] == "overloaded":
        return  # another test's load, not a server error
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_tls(tmp_path):
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    srv = _start(tmp_path, "tls", ["router"], {"router": {"tls_cert": str(cert), "tls_key": str(key)}})
    with srv:
        deadline = time.monotonic() + 60
        while True:
            assert srv.proc.poll() is None, srv.log_tail()
            try:
                r = httpx.get(
                    f"https://127.0.0.1:{srv.port}/health",
                    timeout=10,
                    verify=ssl.create_default_context(cafile=str(cert)),
                )
                break
            except httpx.ConnectError:  # refused: the router binds early but listens only when serving
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"  # HTTPS works; no workers
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=2)


def test_self_registration_heartbeats_and_expiry(tmp_path):
    # Two router replicas: the worker registers with both (--router-url takes a list).
    routers = [
        _start(
            tmp_path,
            f"reg-router-{i}",
            ["router"],
            {"router": {"heartbeat_timeout_s": 1.5, "health_period_s": 0.3}},
        )
        for i in range(2)
    ]
    with routers[0], routers[1]:
        for router in routers:
            _wait_listening(router)
            assert httpx.get(router.url + "/admin/workers").json()["workers"] == []
        # Bound to every interface, as in a container: it must advertise a reachable address.
        w = _start(
            tmp_path,
            "reg-worker",
            [
                "worker",
                "--role",
                "mixed",
                "--router-url",
                ",".join(r.url for r in routers),
                "--host",
                "0.0.0.0",
                "--advertise-host",
                "127.0.0.1",
            ],
            {"router": {"health_period_s": 0.3}},
        )
        with w:
            w.wait_ready(timeout=120)
            for router in routers:
                deadline = time.monotonic() + 30
                while not (
                    healthy := [
                        x for x in httpx.get(router.url + "/admin/workers").json()["workers"] if x["healthy"]
                    ]
                ):
                    assert time.monotonic() < deadline, router.log_tail()
                    time.sleep(0.2)
                assert healthy[0]["url"] == w.url and healthy[0]["id"].endswith(f"@127.0.0.1:{w.port}")
                r = httpx.post(
                    router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
                )
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            w.kill()
            for router in routers:
                deadline = time.monotonic() + 30
                while [x for x in httpx.get(router.url + "/admin/workers").json()["workers"] if x["healthy"]]:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
        for router in routers:
            assert httpx.get(router.url + "/health").status_code == 503


class _FailingWorker:
    """A real HTTP server that passes health checks but answers every generation with a 503:
    a worker whose engine is broken."""

    def __init__(self) -> None:
        import threading

        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI()
        self.calls = 0

        @app.get("/health")
        async def health():
            return {"status": "ok", "worker_id": "broken", "max_model_len": 2048}

        @app.post("/internal/generate")
        async def generate():
            self.calls += 1
            return JSONResponse(
                {
                    "error": {
                        "message": "engine failed",
                        "type": "service_unavailable",
                        "param": None,
                        "code": "engine_dead",
                    }
                },
                status_code=503,
            )

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def test_retries_on_another_worker_and_the_breaker_opens(tmp_path, worker):
    broken = _FailingWorker()
    try:
        srv = _start(
            tmp_path,
            "retry-router",
            [
                "router",
                "--worker",
                f"mixed=http://127.0.0.1:{broken.port}",
                "--worker",
                f"mixed={worker.url}",
            ],
            {
                "server": {"internal_token": TOKEN},
                "router": {
                    "breaker_failures": 3,
                    "breaker_cooldown_s": 60,
                    "retry_backoff_s": 0.01,
                    "admin_keys": [ADMIN],
                },
                "load_balancer": {"decode": "round_robin", "prefill": "round_robin"},
            },
        )
        with srv:
            srv.wait_ready(timeout=60)
            deadline = time.monotonic() + 20
            while (
                len(
                    [
                        w
                        for w in httpx.get(srv.url + "/admin/workers", headers=_auth(ADMIN)).json()["workers"]
                        if w["healthy"]
                    ]
                )
                < 2
            ):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            for _ in range(8):  # every request succeeds: the broken worker's 503s are retried elsewhere
                r = httpx.post(
                    srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
            workers = {
                w["url"]: w
                for w in httpx.get(srv.url + "/admin/workers", headers=_auth(ADMIN)).json()["workers"]
            }
            bad = workers[f"http://127.0.0.1:{broken.port}"]
            assert (
                bad["breaker"] == "open" and bad["retries"] == 3 and broken.calls == 3
            )  # open: no more tries
            assert workers[worker.url]["breaker"] == "closed"
            metrics = httpx.get(srv.url + "/metrics").text
            assert (
                "pdserve_router_worker_retries_total" in metrics
                and "pdserve_router_decisions_total" in metrics
            )
    finally:
        broken.stop()
