"""The Helm chart's laptop deployment (deploy/helm/pdserve/ci/laptop-values.yaml, rendered by Helm's
template engine) runs here for real: the router, prefill and decode containers' own arguments,
environment (the rendered Secret's values filled in, the pod IP 127.0.0.1) and ConfigMap, with only
ports, the model (a tiny one) and threads changed. Client keys, admin keys and the internal token
together: the workers register themselves, a client key gets completions but no admin call, every
/metrics and /health is read with no credentials, as Prometheus and the probes do; then the decode
container's preStop hook drains its worker, which refuses new work from then on."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from deploy_assets import chart_objects

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd, thread_env
from pdserve.protocol import INTERNAL_TOKEN_HEADER

pytestmark = pytest.mark.slow
OBJECTS = chart_objects("laptop")
[_SECRET] = [o for o in OBJECTS if o["kind"] == "Secret"]
SECRETS = _SECRET["stringData"]
CLIENT = SECRETS["api-keys"].split(",")[0]
ADMIN = SECRETS["admin-keys"].split(",")[0]
TOKEN = SECRETS["internal-token"]


def _container(component: str) -> dict:
    [dep] = [
        d
        for d in OBJECTS
        if d["kind"] == "Deployment" and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    [c] = dep["spec"]["template"]["spec"]["containers"]
    return c


def _env(c: dict) -> dict:
    env = {k: v for k, v in thread_env(1).items() if not k.startswith("PDSERVE_")}
    for e in c.get("env", []):
        src = e.get("valueFrom", {})
        if "secretKeyRef" in src:
            assert src["secretKeyRef"]["name"] == _SECRET["metadata"]["name"]
            env[e["name"]] = SECRETS[src["secretKeyRef"]["key"]]
        elif src.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = "127.0.0.1"
        else:
            env[e["name"]] = e["value"]
    return env


def _args(c: dict, config: Path, port: int, router_url: str | None) -> list[str]:
    """The container's args with this machine's ports, config path and router URL."""
    args, out = list(c["args"]), []
    while args:
        a = args.pop(0)
        out.append(a)
        if a in ("--config", "--port", "--kv-port", "--kv-events-endpoint", "--router-url", "--threads"):
            v = args.pop(0)
            out.append(
                {
                    "--config": str(config),
                    "--port": str(port),
                    "--kv-port": str(free_port()),
                    "--router-url": router_url,
                    "--threads": "1",
                    "--kv-events-endpoint": re.sub(r":\d+$", f":{free_port()}", v),
                }.get(a, v)
            )
    return out


def _start(tmp: Path, component: str, config: Path, router_url: str | None = None) -> ServerProcess:
    c = _container(component)
    port = free_port()
    # Ready when serving: the router's /metrics answers before workers register (its /health does not).
    return ServerProcess(
        pdserve_cmd() + _args(c, config, port, router_url),
        port,
        tmp / f"{component}.log",
        env=_env(c),
        health_path="/metrics" if component == "router" else "/health",
    )


def test_the_charts_secured_deployment_end_to_end(tmp_path):
    config_map = next(d for d in OBJECTS if d["kind"] == "ConfigMap")
    cfg = yaml.safe_load(config_map["data"]["pdserve.yaml"])
    cfg["model"]["name"] = "tiny-qwen2"
    config = tmp_path / "pdserve.yaml"
    config.write_text(yaml.safe_dump(cfg))
    router_env = _env(_container("router"))
    assert {"PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEYS", "PDSERVE_INTERNAL_TOKEN"} <= set(router_env)

    with _start(tmp_path, "router", config) as router:
        router.wait_ready(timeout=180)
        with (
            _start(tmp_path, "prefill", config, router.url) as prefill,
            _start(tmp_path, "decode", config, router.url) as decode,
        ):
            prefill.wait_ready(timeout=300)
            decode.wait_ready(timeout=300)
            admin = {"Authorization": f"Bearer {ADMIN}"}
            deadline = time.monotonic() + 120
            while True:  # the workers registered themselves with the internal token
                r = httpx.get(router.url + "/admin/workers", headers=admin, timeout=10)
                assert r.status_code == 200, r.text
                if sorted(w["role"] for w in r.json()["workers"] if w["healthy"]) == ["decode", "prefill"]:
                    break
                assert time.monotonic() < deadline, router.log_tail() + decode.log_tail()
                time.sleep(0.3)

            client = openai.OpenAI(base_url=router.url + "/v1", api_key=CLIENT, max_retries=0, timeout=120)
            got = client.completions.create(
                model="tiny-qwen2",
                prompt="The deployment works:",
                max_tokens=5,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert got.usage.completion_tokens == 5
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()

            # The admin API: 401 without a key, 403 with a client key, 200 with an admin key.
            some = r.json()["workers"][0]["id"]
            for method, path in (
                ("GET", "/admin/workers"),
                ("POST", f"/admin/workers/{some}/drain"),
                ("DELETE", f"/admin/workers/{some}"),
            ):
                assert httpx.request(method, router.url + path, timeout=10).status_code == 401
                r = httpx.request(
                    method, router.url + path, headers={"Authorization": f"Bearer {CLIENT}"}, timeout=10
                )
                assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
            reg = {"worker_id": "rogue", "role": "decode", "model": "tiny-qwen2", "url": "http://127.0.0.1:9"}
            r = httpx.post(
                router.url + "/admin/workers/register",
                json=reg,
                timeout=10,
                headers={"Authorization": f"Bearer {CLIENT}"},
            )
            assert r.status_code == 403 and r.json()["error"]["code"] == "internal_token_required"
            assert httpx.post(router.url + "/admin/workers/register", json=reg, timeout=10).status_code == 401
            ids = [w["id"] for w in httpx.get(router.url + "/admin/workers", headers=admin).json()["workers"]]
            assert "rogue" not in ids and len(ids) == 2

            # Prometheus scrapes every pod without credentials; probes read /health the same way.
            for srv, metric in (
                (router, "pdserve_router_worker_healthy"),
                (prefill, "pdserve_"),
                (decode, "pdserve_"),
            ):
                r = httpx.get(srv.url + "/metrics", timeout=10)
                assert r.status_code == 200 and metric in r.text, (srv.url, r.status_code)
                assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            for srv in (prefill, decode):
                assert "refuses" not in srv.log_tail(100_000)

            # The preStop hook, as the kubelet runs it in the decode container (its port this one's).
            hook = _container("decode")["lifecycle"]["preStop"]["exec"]["command"]
            assert hook[0] == "python"
            code = hook[2].replace("127.0.0.1:8000/", f"127.0.0.1:{decode.port}/")
            assert code != hook[2]
            env = _env(_container("decode"))
            done = subprocess.run(
                [sys.executable, *hook[1:2], code], env=env, capture_output=True, timeout=120
            )
            assert done.returncode == 0, done.stderr.decode()
            job = {"request_id": "after-drain", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 1}}
            r = httpx.post(
                decode.url + "/internal/generate",
                json=job,
                headers={INTERNAL_TOKEN_HEADER: TOKEN},
                timeout=10,
            )
            assert r.status_code == 503 and "leaving" in r.json()["error"]["message"], r.text
            assert httpx.get(decode.url + "/metrics", timeout=10).status_code == 200  # still alive
    log = router.log_path.read_text(errors="replace")
    assert "!!!" not in log and "cannot register" not in log and ADMIN not in log and CLIENT not in log
