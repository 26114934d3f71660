"""Who may call what on the router: client keys, admin keys, the internal token, open paths.

The router app is the real one (create_router_app), spoken to over ASGI in this process; the
same combination runs as real processes in tests/deploy/test_chart_e2e.py.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from api_errors import openai_error as _error

from pdserve.config import load_config
from pdserve.protocol import INTERNAL_TOKEN_HEADER

CLIENT, ADMIN, TOKEN = "sk-client-1", "sk-admin-1", "internal-secret"
REG = {"worker_id": "w-1", "role": "decode", "model": "tiny-qwen2", "url": "http://127.0.0.1:1", "pid": 1}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEYS", "PDSERVE_INTERNAL_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def _calls(router: dict | None = None, token: str | None = None, host: str = "127.0.0.1"):
    """A function sending (method, path, headers) to a router app built from this config."""
    from pdserve.router.gateway import create_router_app

    config = load_config(
        overrides={
            "model.name": "tiny-qwen2",
            "router.encoder_workers": 0,
            "server.internal_token": token,
            "server.host": host,
            **{f"router.{k}": v for k, v in (router or {}).items()},
        }
    )
    app = create_router_app(config)

    def call(method: str, path: str, key: str | None = None, token: str | None = None, json=None):
        headers = {}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if token:
            headers[INTERNAL_TOKEN_HEADER] = token

        async def go():
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app, client=("10.1.2.3", 5000)), base_url="http://router"
            ) as c:
                return await c.request(method, path, headers=headers, json=json)

        return asyncio.run(go())

    return call


def test_admin_routes_need_an_admin_key_and_client_keys_get_403():
    call = _calls({"api_keys": [CLIENT], "admin_keys": [ADMIN]})
    for method, path in (
        ("GET", "/admin/workers"),
        ("POST", "/admin/workers/w-9/drain"),
        ("DELETE", "/admin/workers/w-9"),
    ):
        assert _error(call(method, path), 401)["type"] == "authentication_error"
        assert _error(call(method, path, key="sk-wrong"), 401)["type"] == "authentication_error"
        err = _error(call(method, path, key=CLIENT), 403)
        assert err["type"] == "permission_error" and err["code"] == "admin_key_required"
    assert call("GET", "/admin/workers", key=ADMIN).json() == {"workers": []}
    assert _error(call("POST", "/admin/workers/w-9/drain", key=ADMIN), 404)["code"] == "unknown_worker"
    # The OpenAI routes take a client key, and an admin key too.
    assert call("GET", "/v1/models", key=CLIENT).status_code == 200
    assert call("GET", "/v1/models", key=ADMIN).status_code == 200
    assert _error(call("GET", "/v1/models"), 401)["code"] == "invalid_api_key"


def test_any_key_closes_the_admin_api(monkeypatch):
    # Admin keys alone (from the environment): the OpenAI routes stay open, /admin/* does not.
    monkeypatch.setenv("PDSERVE_ADMIN_KEYS", "sk-env-admin-a, sk-env-admin-b")
    call = _calls()
    _error(call("GET", "/admin/workers"), 401)
    assert call("GET", "/admin/workers", key="sk-env-admin-b").status_code == 200
    assert call("GET", "/v1/models").status_code == 200
    monkeypatch.delenv("PDSERVE_ADMIN_KEYS")
    # Client keys alone: no key opens /admin/* (a client key is never enough).
    call = _calls({"api_keys": [CLIENT]})
    _error(call("GET", "/admin/workers"), 401)
    _error(call("GET", "/admin/workers", key=CLIENT), 403)


def test_registration_takes_the_internal_token_never_a_client_key(monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", TOKEN)
    call = _calls({"api_keys": [CLIENT], "admin_keys": [ADMIN]})
    err = _error(call("POST", "/admin/workers/register", key=CLIENT, json=REG), 403)
    assert err["code"] == "internal_token_required"
    _error(call("POST", "/admin/workers/register", json=REG), 401)
    _error(call("POST", "/admin/workers/register", token="wrong", json=REG), 401)
    assert call("GET", "/admin/workers", key=ADMIN).json() == {"workers": []}  # nothing got in
    r = call("POST", "/admin/workers/register", token=TOKEN, json=REG)
    assert r.status_code == 200 and r.json()["id"] == "w-1"
    _error(call("POST", "/admin/workers/w-1/heartbeat", key=CLIENT), 403)
    _error(call("POST", "/admin/workers/w-1/heartbeat"), 401)
    assert call("POST", "/admin/workers/w-1/heartbeat", token=TOKEN).json() == {"ok": True}
    # The token opens registration only: not the admin API, nor the OpenAI routes.
    _error(call("GET", "/admin/workers", token=TOKEN), 401)
    _error(call("POST", "/admin/workers/w-1/drain", token=TOKEN), 401)
    _error(call("GET", "/v1/models", token=TOKEN), 401)
    assert [w["id"] for w in call("GET", "/admin/workers", key=ADMIN).json()["workers"]] == ["w-1"]


def test_without_a_token_registration_needs_an_admin_key_once_keys_are_set():
    call = _calls({"api_keys": [CLIENT], "admin_keys": [ADMIN]})
    _error(call("POST", "/admin/workers/register", key=CLIENT, json=REG), 403)
    _error(call("POST", "/admin/workers/register", json=REG), 401)
    assert call("POST", "/admin/workers/register", key=ADMIN, json=REG).status_code == 200
    # With a token but no keys, registration still needs the token.
    call = _calls(token=TOKEN)
    _error(call("POST", "/admin/workers/register", json=REG), 401)
    assert call("POST", "/admin/workers/register", token=TOKEN, json=REG).status_code == 200


def test_the_internal_token_alone_closes_the_admin_api():
    """A router with only the internal token (as the launcher made one for the local controller):
    the admin API takes nobody, not even the token's holders (a worker started through it inherits
    the token); registration still takes the token, and the OpenAI API stays open (no client keys)."""
    call = _calls(token=TOKEN)
    for method, path, body in (
        ("PUT", "/admin/canary", {"version": "v", "weight": 1.0}),
        ("GET", "/admin/workers", None),
        ("GET", "/admin/canary", None),
        ("GET", "/admin/controller", None),
        ("POST", "/admin/workers", {"role": "decode", "config": {"server": {"router_url": "http://x"}}}),
        ("POST", "/admin/workers/w-1/drain", None),
        ("DELETE", "/admin/workers/w-1", None),
    ):
        assert _error(call(method, path, json=body), 401)["code"] == "invalid_api_key", (method, path)
        _error(call(method, path, token=TOKEN, json=body), 401)
    assert call("POST", "/admin/workers/register", token=TOKEN, json=REG).status_code == 200
    assert call("GET", "/v1/models").status_code == 200


def test_a_router_off_loopback_needs_an_admin_key_to_start(monkeypatch):
    from pdserve.config import ConfigError

    for host in ("0.0.0.0", "::", "192.168.1.7"):
        for token in (None, TOKEN):
            with pytest.raises(ConfigError) as e:
                _calls({"api_keys": [CLIENT]}, token=token, host=host)
            [(key, problem)] = e.value.problems
            assert (
                key == "router.admin_keys"
                and "PDSERVE_ADMIN_KEYS" in problem
                and "--insecure-admin" in problem
            )
        _calls({"admin_keys": [ADMIN]}, host=host)
        _calls({"insecure_admin": True}, host=host)
    _calls(host="127.0.0.1")  # the laptop default needs nothing
    monkeypatch.setenv("PDSERVE_ADMIN_KEYS", ADMIN)
    _calls(host="0.0.0.0")


def test_the_command_line_exits_2_naming_the_setting(tmp_path):
    """`pdserve router` and `pdserve serve` refuse before anything starts; loopback needs no flag."""
    import os
    import subprocess

    from pdserve.bench.procs import pdserve_cmd

    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            pdserve_cmd() + [*args, "--model", "tiny-qwen2"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )

    for args in (["router", "--host", "0.0.0.0", "--port", "0"], ["serve", "--host", "0.0.0.0", "--dry-run"]):
        out = run(*args)
        assert (
            out.returncode == 2 and "router.admin_keys" in out.stderr and "--insecure-admin" in out.stderr
        ), out
    assert run("serve", "--host", "0.0.0.0", "--insecure-admin", "--dry-run").returncode == 0
    assert run("serve", "--dry-run").returncode == 0


def test_nothing_configured_is_open():
    call = _calls()
    assert call("POST", "/admin/workers/register", json=REG).status_code == 200
    assert call("POST", "/admin/workers/w-1/drain").json()["draining"] is True
    assert call("GET", "/v1/models").status_code == 200


def test_health_and_metrics_are_open_with_keys_and_token():
    call = _calls({"api_keys": [CLIENT], "admin_keys": [ADMIN]}, token=TOKEN)
    assert _error(call("GET", "/health"), 503)["code"] == "no_workers"  # open: no worker yet, not a 401
    r = call("GET", "/metrics")
    assert r.status_code == 200 and "pdserve_router_rejected_total" in r.text


def test_heartbeats_are_not_charged_to_the_rate_limit():
    call = _calls({"requests_per_minute": 2}, token=TOKEN)
    assert call("POST", "/admin/workers/register", token=TOKEN, json=REG).status_code == 200
    for _ in range(5):  # a worker beats every health period, more than any client's budget
        assert call("POST", "/admin/workers/w-1/heartbeat", token=TOKEN).status_code == 200
    codes = [call("GET", "/v1/models").status_code for _ in range(3)]
    assert codes == [200, 200, 429]


@pytest.mark.parametrize(
    "host,loud",
    [
        ("0.0.0.0", True),
        ("::", True),
        ("192.168.1.7", True),
        ("127.0.0.1", False),
        ("localhost", False),
        ("::1", False),
    ],
)
def test_an_open_router_on_a_public_address_warns(host, loud):
    from pdserve.router.access import exposure_warnings

    got = exposure_warnings(host, client_keys=False, admin_keys=False, token=False)
    assert bool(got) == loud
    if loud:
        assert "anyone" in got[0] and "PDSERVE_ADMIN_KEYS" in got[0] and "PDSERVE_INTERNAL_TOKEN" in got[0]
    assert exposure_warnings(host, client_keys=True, admin_keys=True, token=True) == []
    # Keys without a token: workers cannot register themselves; said wherever it is bound.
    [line] = exposure_warnings(host, client_keys=True, admin_keys=True, token=False)
    assert "register" in line and "PDSERVE_INTERNAL_TOKEN" in line


def test_the_router_logs_the_warning_when_it_starts(caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        _calls({"insecure_admin": True}, host="0.0.0.0")
    assert any(r.levelno == logging.WARNING and "anyone" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        _calls(host="127.0.0.1")
    assert not [r for r in caplog.records if "anyone" in r.getMessage()]


def test_a_worker_self_registers_with_the_token_and_says_so_when_refused(caplog):
    """The worker's registration loop against the real router app on a real socket."""
    import threading
    import time

    import uvicorn

    from pdserve.bench.procs import free_port
    from pdserve.router.gateway import create_router_app
    from pdserve.server.registration import register_with_routers

    port = free_port()
    config = load_config(
        overrides={
            "model.name": "tiny-qwen2",
            "router.encoder_workers": 0,
            "server.internal_token": TOKEN,
            "router.api_keys": [CLIENT],
            "router.admin_keys": [ADMIN],
            "router.health_period_s": 0.2,
        }
    )
    server = uvicorn.Server(
        uvicorn.Config(create_router_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def worker_config(token: str):
        return load_config(
            overrides={
                "server.router_url": url,
                "server.internal_token": token,
                "server.port": 1,
                "worker.role": "decode",
                "worker.worker_id": "self-1",
                "router.health_period_s": 0.2,
            }
        )

    async def run_until(token: str, done) -> None:
        task = asyncio.create_task(register_with_routers(worker_config(token), "tiny-qwen2"))
        try:
            deadline = time.monotonic() + 60
            while not await asyncio.to_thread(done):
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.05)
        finally:
            task.cancel()

    def listed() -> list[str]:
        r = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"})
        return [w["id"] for w in r.json()["workers"]]

    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        with caplog.at_level(logging.ERROR, logger="pdserve.server.registration"):
            asyncio.run(
                run_until("wrong-token", lambda: any("refuses" in r.getMessage() for r in caplog.records))
            )
        assert listed() == []
        asyncio.run(run_until(TOKEN, lambda: listed() == ["self-1"]))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
