"""A deployment spanning "hosts" without Kubernetes: a host agent (`pdserve agent`) starts the
workers, a router (`pdserve router`, controller.backend: hosts) asks it for more and fewer.
- the agent takes only the internal token (a client or admin key reaches nothing there), and will
  not run without one;
- `pdserve rollout` under load replaces both workers through the agent: each new one on the host of
  the one it replaces, the old ones stopped by the agent, no request failed, every greedy output
  equal to the offline engine's, and a rollout of the old config back (a rollback) the same;
- a killed worker restarted by its agent comes back at its URL;
- a start sent again with its idempotency key makes no second worker, and a fleet stops the worker
  of a start it never saw confirmed.
Real processes on loopback; the namespace-host version of this runs in benchmarks/chaos_soak.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import httpx
import pytest
import yaml
from load_client import ADMIN, MODEL, Load, offline_outputs, pool_at_start, wait_for, workers

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.config import load_config
from pdserve.control.host_fleet import HostsFleet
from pdserve.protocol import INTERNAL_TOKEN_HEADER
from pdserve.version import config_digest, version_label

pytestmark = pytest.mark.slow

TOKEN = "host-fleet-token"
SLO_FLAGS = ["--window-s", "1.5", "--canary-weight", "0.5", "--slo-ttft-ms", "60000"]
SLO_FLAGS += ["--slo-tpot-ms", "60000", "--max-error-rate", "0.2"]


def _config(tmp_path, name: str, agent: str, **scheduler) -> tuple[str, str]:
    path = tmp_path / name
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"name": MODEL},
                "server": {"internal_token": TOKEN, "shutdown_timeout_s": 5},
                "router": {"admin_keys": [ADMIN], "health_period_s": 0.2},
                "controller": {"backend": "hosts", "agents": [agent], "drain_timeout_s": 1.0},
                "scheduler": scheduler,
            }
        )
    )
    return str(path), version_label(config_digest(load_config(path))) or ""


def _agent_call(agent: str, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, agent + path, headers={INTERNAL_TOKEN_HEADER: TOKEN}, timeout=60, **kw)


def _alive(agent: str) -> list[dict]:
    return [w for w in _agent_call(agent, "GET", "/agent/workers").json()["workers"] if w["alive"]]


def _rollout(url: str, config: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        pdserve_cmd() + ["rollout", "--config", config, "--router", url, "--admin-key", ADMIN, *SLO_FLAGS],
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_an_agent_needs_the_internal_token(tmp_path):
    cfg = tmp_path / "open.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": MODEL}}))
    out = subprocess.run(
        pdserve_cmd() + ["agent", "--config", str(cfg), "--host", "127.0.0.1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in __import__("os").environ.items() if k != "PDSERVE_INTERNAL_TOKEN"},
    )
    assert out.returncode == 2 and "server.internal_token" in out.stderr, out.stderr


def test_rollout_and_rollback_through_a_host_agent(tmp_path):
    want = offline_outputs()
    agent_port, router_port = free_port(), free_port()
    agent = f"http://127.0.0.1:{agent_port}"
    url = f"http://127.0.0.1:{router_port}"
    old_cfg, old_version = _config(tmp_path, "old.yaml", agent)
    new_cfg, new_version = _config(tmp_path, "new.yaml", agent, max_num_seqs=32)
    assert old_version != new_version
    agent_cmd = pdserve_cmd() + ["agent", "--config", old_cfg, "--host", "127.0.0.1"]
    agent_cmd += ["--port", str(agent_port), "--router-url", url, "--threads", "1"]
    agent_cmd += ["--log-dir", str(tmp_path / "agent")]
    router_cmd = pdserve_cmd() + ["router", "--config", old_cfg, "--port", str(router_port)]
    with (
        ServerProcess(agent_cmd, agent_port, tmp_path / "agent.log") as ag,
        ServerProcess(router_cmd, router_port, tmp_path / "router.log", health_path="/metrics") as rt,
    ):
        ag.wait_ready(timeout=60)
        rt.wait_ready(timeout=120)
        # Least privilege: neither no secret nor an admin key starts anything on the host.
        for headers in ({}, {"Authorization": f"Bearer {ADMIN}"}):
            r = httpx.post(agent + "/agent/workers", json={"role": "decode", "config": {}}, headers=headers)
            assert r.status_code in (401, 403), r.text
        assert httpx.get(agent + "/health").json()["workers"] == 0
        # The deployment's first workers, started on the host through its agent.
        config = yaml.safe_load(open(old_cfg))
        for role in ("prefill", "decode"):
            r = _agent_call(agent, "POST", "/agent/workers", json={"role": role, "config": config})
            assert r.status_code == 201, r.text
        bad = _agent_call(agent, "POST", "/agent/workers", json={"role": "decode", "config": {"x": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "config", bad.text
        wait_for(
            lambda: sorted(w["role"] for w in workers(url).values() if w["healthy"]) == ["decode", "prefill"],
            "the agent's workers registered and healthy at the router",
            timeout=300,
        )
        first = {w["pid"] for w in _alive(agent)}

        for cfg, version, what in ((new_cfg, new_version, "rollout"), (old_cfg, old_version, "rollback")):
            load = Load(url)
            try:
                load.progress(4, f"no progress before the {what}")
                out = _rollout(url, cfg)
                load.progress(4, f"no progress after the {what}")
            finally:
                load.finish()
            print(out.stdout)
            assert out.returncode == 0, out.stdout + out.stderr
            assert load.errors == [] and load.wrong(want) == []
            now = workers(url)
            assert sorted(w["role"] for w in now.values()) == ["decode", "prefill"], now
            assert {w["version"] for w in now.values()} == {version}
            alive = _alive(agent)  # the replaced ones stopped by the agent, the new ones its own
            assert sorted(w["url"] for w in alive) == sorted(w["url"] for w in now.values())
            assert not {w["pid"] for w in alive} & first
            first = {w["pid"] for w in alive}
            for w in now.values():
                assert pool_at_start(w["url"])["config_digest"] == version.split("+")[1]

        # A worker the rollback started (its port picked free) killed, then restarted by its agent,
        # as a supervisor would: it comes back at its URL, so the router knows one worker there,
        # not a dead entry beside a new one (a later rollout would replace both).
        dead = next(w for w in _alive(agent) if w["role"] == "decode")
        os.kill(dead["pid"], signal.SIGKILL)
        wait_for(lambda: not any(w["id"] == dead["id"] for w in _alive(agent)), "the killed worker exited")
        r = _agent_call(agent, "POST", f"/agent/workers/{dead['id']}/restart")
        assert r.status_code == 201, r.text
        back = wait_for(
            lambda: next((w for w in _alive(agent) if w["id"] == r.json()["id"] and w["url"]), None),
            "the restarted worker listed with its URL",
        )
        assert back["url"] == dead["url"] and back["pid"] != dead["pid"], (dead, back)
        wait_for(
            lambda: (
                [(w["url"], w["healthy"]) for w in workers(url).values() if w["role"] == "decode"]
                == [(dead["url"], True)]
            ),
            "the restarted worker healthy at its URL, alone in the decode pool",
            timeout=300,
        )

        # A start sent again with its key (its reply was lost) answers with the worker that start
        # made, and makes no other.
        body = {"role": "prefill", "config": config, "request_id": "lost-reply-1"}
        a, b = (_agent_call(agent, "POST", "/agent/workers", json=body) for _ in range(2))
        assert a.status_code == b.status_code == 201 and a.json()["id"] == b.json()["id"], (a.text, b.text)
        assert [w["id"] for w in _alive(agent) if w["request_id"] == "lost-reply-1"] == [a.json()["id"]]
        # A fleet that never saw that start confirmed stops its worker once the agent lists it.
        fleet = HostsFleet(load_config(old_cfg), [agent], TOKEN, tmp_path / "fleet")
        fleet._abandoned[agent] = {"lost-reply-1"}  # as _start_on leaves it when no attempt got a reply

        async def list_and_settle() -> None:
            await fleet._listing()
            await asyncio.gather(*fleet._tasks)
            await fleet.aclose()

        asyncio.run(list_and_settle())
        assert not any(w["id"] == a.json()["id"] for w in _alive(agent))
