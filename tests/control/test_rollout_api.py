"""The router's rollout routes on the real router app (create_router_app over ASGI, in this process):
the version label in GET /admin/workers, the canary API, and the refusals of POST /admin/workers
and retire (no fleet, a bad config naming its key, another model, an unknown version or worker),
each an admin route with an OpenAI-style error body. Starting and retiring real workers:
tests/control/test_rollout_e2e.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from api_errors import openai_error as _error

from pdserve.config import ConfigError, load_config
from pdserve.control.local_fleet import LocalFleet

ADMIN = "sk-admin-r"
REG = {
    "worker_id": "w-1",
    "role": "decode",
    "model": "tiny-qwen2",
    "url": "http://127.0.0.1:1",
    "pid": 1,
    "pdserve_version": "0.1.0",
    "config_digest": "abcdefabcdef",
}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEYS", "PDSERVE_INTERNAL_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def _router(fleet_dir=None):
    from pdserve.router.gateway import create_router_app

    config = load_config(
        overrides={"model.name": "tiny-qwen2", "router.encoder_workers": 0, "router.admin_keys": [ADMIN]}
    )
    fleet = (
        LocalFleet(config, [], fleet_dir / "deployment.yaml", fleet_dir, "http://127.0.0.1:1")
        if fleet_dir
        else None
    )
    app = create_router_app(config, fleet)

    def call(method: str, path: str, key: str | None = ADMIN, json=None) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://router"
            ) as c:
                return await c.request(
                    method, path, json=json, headers={"Authorization": f"Bearer {key}"} if key else {}
                )

        return asyncio.run(go())

    return call


def test_version_label_and_canary_api():
    call = _router()
    assert call("POST", "/admin/workers/register", json=REG).status_code == 200
    [w] = call("GET", "/admin/workers").json()["workers"]
    assert (w["version"], w["pdserve_version"], w["config_digest"]) == (
        "0.1.0+abcdefabcdef",
        "0.1.0",
        "abcdefabcdef",
    )

    assert call("GET", "/admin/canary").json() == {"version": None, "weight": None}
    _error(call("PUT", "/admin/canary", key=None, json={"version": "v", "weight": 0.5}), 401)
    assert call("PUT", "/admin/canary", json={"version": w["version"], "weight": 0.25}).json() == {
        "version": w["version"],
        "weight": 0.25,
    }
    assert call("GET", "/admin/canary").json()["weight"] == 0.25
    for bad in (
        {"version": "v", "weight": 1.5},
        {"version": "", "weight": 0.5},
        {"weight": 0.5},
        {"version": "v", "weight": 0.5, "extra": 1},
    ):
        _error(call("PUT", "/admin/canary", json=bad), 400)
    assert call("DELETE", "/admin/canary").json() == {"version": None, "weight": None}


def test_starting_and_retiring_workers_needs_a_fleet():
    call = _router()
    assert (
        _error(call("POST", "/admin/workers", json={"role": "decode", "version": "x"}), 501)["code"]
        == "no_fleet"
    )
    assert call("POST", "/admin/workers/register", json=REG).status_code == 200
    assert _error(call("POST", "/admin/workers/w-1/retire", json={}), 501)["code"] == "no_fleet"
    assert _error(call("POST", "/admin/workers/nobody/retire", json={}), 404)["code"] == "unknown_worker"
    _error(call("POST", "/admin/workers", json={"role": "encoder", "version": "x"}), 400)
    _error(call("POST", "/admin/workers", key=None, json={"role": "decode", "version": "x"}), 401)


def test_a_start_is_refused_before_any_process_when_its_config_is_wrong(tmp_path):
    call = _router(tmp_path)
    err = _error(call("POST", "/admin/workers", json={"role": "decode"}), 400)
    assert "one of config" in err["message"]
    err = _error(
        call("POST", "/admin/workers", json={"role": "decode", "config": {"scheduler": {"max_num_seqs": 0}}}),
        400,
    )
    assert err["param"] == "config" and "scheduler.max_num_seqs" in err["message"]
    err = _error(
        call("POST", "/admin/workers", json={"role": "decode", "config": {"model": {"name": "tiny-llama"}}}),
        409,
    )
    assert err["code"] == "model_mismatch"
    err = _error(
        call("POST", "/admin/workers", json={"role": "prefill", "version": "0.1.0+000000000000"}), 404
    )
    assert err["code"] == "unknown_version"
    assert not list(tmp_path.glob("*.log"))  # no worker was started


def test_a_start_cannot_point_a_worker_elsewhere(tmp_path):
    """A new worker holds the internal token and the deployment's KV and prompts: the admin API may
    not choose its router, peers, encoders, remote tier, trace collector, image fetches or secrets."""
    call = _router(tmp_path)
    hostile = {
        "model": {"name": "tiny-qwen2"},
        "server": {
            "router_url": "http://203.0.113.9:8000",
            "otlp_endpoint": "http://203.0.113.9:4318",
            "internal_token": "mine",
        },
        "cache": {
            "remote": "redis://203.0.113.9:6379/0",
            "kv_events_endpoint": "tcp://0.0.0.0:5557",
            "disk_cache_dir": str(tmp_path / "elsewhere"),
        },
        "disagg": {"prefill_endpoints": ["tcp://203.0.113.9:7000"]},
        "vision": {"encoder_endpoints": ["tcp://203.0.113.9:7100"], "allow_remote_urls": True},
    }
    err = _error(
        call("POST", "/admin/workers", json={"role": "decode", "config": hostile, "timeout_s": 60}), 400
    )
    named = {
        "server.router_url",
        "server.otlp_endpoint",
        "server.internal_token",
        "cache.remote",
        "cache.kv_events_endpoint",
        "cache.disk_cache_dir",
        "disagg.prefill_endpoints",
        "vision.encoder_endpoints",
        "vision.allow_remote_urls",
    }
    assert err["param"] == "config" and all(k in err["message"] for k in named), err["message"]
    assert not list(tmp_path.glob("*.log"))  # no worker was started


def test_a_new_version_changes_what_a_worker_computes_and_keeps_the_rest(tmp_path):
    """What `pdserve rollout` sends (a whole config: another max_num_seqs, its own rollout settings,
    defaults for the process's ports) is taken; the worker's file has the deployment's endpoints and
    token, and neither the client nor the admin keys."""
    import yaml

    from pdserve.control.rollout_keys import rollout_worker_config

    deployment = load_config(
        overrides={
            "model.name": "tiny-qwen2",
            "server.host": "0.0.0.0",
            "server.port": 9000,
            "server.internal_token": "tok",
            "server.otlp_endpoint": "http://collector:4318",
            "cache.remote": "redis://kv:6379/0",
            "router.api_keys": ["sk-client"],
            "router.admin_keys": [ADMIN],
            "rollout.window_s": 5.0,
        }
    )
    new = load_config(
        overrides={
            "model.name": "tiny-qwen2",
            "scheduler.max_num_seqs": 7,
            "rollout.window_s": 9.0,
            "server.otlp_endpoint": "http://collector:4318",
            "cache.remote": "redis://kv:6379/0",
        }
    )
    got = rollout_worker_config(deployment, new)
    assert (
        got.scheduler.max_num_seqs == 7
        and got.router == deployment.router
        and got.rollout == deployment.rollout
    )
    assert (got.server.internal_token, got.server.host, got.cache.remote) == (
        "tok",
        "0.0.0.0",
        "redis://kv:6379/0",
    )
    # A remote tier or collector the deployment has and the new version leaves out changes what runs: said.
    with pytest.raises(ConfigError, match="cache.remote"):
        rollout_worker_config(
            deployment,
            load_config(
                overrides={"model.name": "tiny-qwen2", "server.otlp_endpoint": "http://collector:4318"}
            ),
        )
    fleet = LocalFleet(deployment, [], tmp_path / "deployment.yaml", tmp_path, "http://127.0.0.1:1")
    path, written = fleet.write_config(new.to_dict())
    text = path.read_text()
    assert "sk-client" not in text and ADMIN not in text
    data = yaml.safe_load(text)
    assert data["router"]["api_keys"] == data["router"]["admin_keys"] == []
    assert data["scheduler"]["max_num_seqs"] == 7 and data["cache"]["remote"] == "redis://kv:6379/0"
