"""A worker's transitions are all or nothing, with the failure injected:
- a role switch whose new KV connector cannot be built leaves the worker in its old role with a
  working connector (a 503 naming it), not a healthy-looking worker with a closed one; where the old
  connector cannot come back either, the engine is out of service (its /health says so);
- a scale-down that fails after the worker emptied itself (its process is not the fleet's to stop)
  puts it back into service on both sides: the router sends it requests and it serves them, rather
  than handing each back (the real router app, a real worker process)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml
from load_client import ADMIN, MODEL

import pdserve.server.role_switch as worker_switch
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.config import load_config
from pdserve.engine.async_engine import AsyncEngine
from pdserve.server.errors import APIError
from pdserve.server.roles import build_engine


def _prefill_worker():
    config = load_config(
        overrides={
            "model.name": MODEL,
            "worker.role": "prefill",
            "transfer.backend": "tcp",
            "server.host": "127.0.0.1",
            "cache.device_blocks": 64,
        }
    )
    engine = build_engine(config)
    eng = AsyncEngine(engine)
    eng.start()
    return config, engine, eng


def _alive(connector) -> bool:
    return connector.endpoint is not None and all(t.is_alive() for t in connector._threads)


def test_a_switch_whose_new_connector_fails_keeps_the_old_role(monkeypatch):
    config, engine, eng = _prefill_worker()
    switch = worker_switch.RoleSwitch(config, eng)
    real = worker_switch.build_connector
    old = engine.connector

    def fail_decode(cfg, role, e):
        if role == "decode":
            raise OSError("injected: the decode KV socket could not bind")
        return real(cfg, role, e)

    monkeypatch.setattr(worker_switch, "build_connector", fail_decode)
    with pytest.raises(APIError) as err:
        asyncio.run(switch.switch("decode", 0.0))
    assert err.value.status == 503 and err.value.code == "switch_failed" and "still prefill" in str(err.value)
    assert switch.role == "prefill" and eng.dead is None and not switch.switching
    assert engine.connector is not old and _alive(engine.connector)  # the prefill connector, reopened
    assert switch.describe(0)["kv_endpoint"] == engine.connector.endpoint

    # Nothing is left half-done: the same switch goes through once the connector can be built.
    monkeypatch.setattr(worker_switch, "build_connector", real)
    assert asyncio.run(switch.switch("decode", 0.0))["role"] == "decode"
    eng.shutdown()
    engine.connector.close()


def test_a_switch_that_cannot_restore_either_takes_the_engine_out(monkeypatch):
    config, engine, eng = _prefill_worker()
    switch = worker_switch.RoleSwitch(config, eng)

    def fail(cfg, role, e):
        raise OSError(f"injected: no {role} connector")

    monkeypatch.setattr(worker_switch, "build_connector", fail)
    with pytest.raises(APIError) as err:
        asyncio.run(switch.switch("decode", 0.0))
    assert err.value.status == 503 and "nor the prefill one" in str(err.value)
    assert eng.dead is not None  # /health answers 503 engine_dead: the router takes it out
    eng.shutdown()


def _worker(tmp_path, name: str) -> ServerProcess:
    port = free_port()
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": MODEL}, "cache": {"device_blocks": 128}}))
    cmd = pdserve_cmd() + ["worker", "--role", "mixed", "--config", str(cfg), "--port", str(port)]
    return ServerProcess(cmd, port, tmp_path / f"{name}.log")


@pytest.mark.slow
def test_a_failed_scale_down_puts_the_worker_back_into_service(tmp_path):
    from pdserve.control.local_fleet import LocalFleet
    from pdserve.router.gateway import create_router_app

    with _worker(tmp_path, "a") as a, _worker(tmp_path, "b") as b:
        a.wait_ready(timeout=180)
        b.wait_ready(timeout=180)
        config = load_config(
            overrides={
                "model.name": MODEL,
                "router.encoder_workers": 0,
                "router.admin_keys": [ADMIN],
                "router.health_period_s": 0.2,
                "router.workers": [{"url": a.url, "role": "mixed"}, {"url": b.url, "role": "mixed"}],
            }
        )
        # A fleet that did not start these workers: removing a process fails after it has emptied.
        fleet = LocalFleet(config, [], tmp_path / "deployment.yaml", tmp_path, "http://127.0.0.1:1")
        app = create_router_app(config, fleet)
        body = {"model": MODEL, "prompt": "the worker stays", "max_tokens": 4, "temperature": 0}
        headers = {"Authorization": f"Bearer {ADMIN}"}

        async def go():
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://router", timeout=120
                ) as c,
            ):
                for _ in range(600):
                    ws = (await c.get("/admin/workers", headers=headers)).json()["workers"]
                    if len(ws) == 2 and all(w["healthy"] for w in ws):
                        break
                    await asyncio.sleep(0.1)
                ids = {w["url"]: w["id"] for w in ws}
                before = await c.post("/v1/completions", json=body)
                r = await c.post(
                    f"/admin/workers/{ids[a.url]}/retire", json={"drain_timeout_s": 0}, headers=headers
                )
                # b out of rotation: what the router sends now goes to a, which must serve it.
                assert (
                    await c.post(f"/admin/workers/{ids[b.url]}/drain", headers=headers)
                ).status_code == 200
                ws = {w["url"]: w for w in (await c.get("/admin/workers", headers=headers)).json()["workers"]}
                after = [await c.post("/v1/completions", json=body) for _ in range(3)]
                return before, r, ws[a.url], after

        before, r, a_now, after = asyncio.run(go())
        assert before.status_code == 200, before.text
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_in_fleet", r.text
        assert not a_now["draining"] and a_now["healthy"]
        for res in after:  # served by a, not handed back to a router with nowhere else to send it
            assert res.status_code == 200, res.text
            assert res.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
