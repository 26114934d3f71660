"""The controller's Kubernetes path: the official `kubernetes` client, configured from a kubeconfig
as on a laptop, against a local HTTP server that plays the API server (Deployments' scale
subresource, pods) and records every call. Adding a worker scales the pool's Deployment up; removing
one marks its pod (found by IP, in whichever pool's Deployment it started) with the lowest deletion
cost, then scales that Deployment down."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from pdserve.config import ControllerConfig
from pdserve.control.k8s_fleet import DELETION_COST, KubernetesFleet
from pdserve.router.registry import Breaker, Worker

pytest.importorskip("kubernetes")
NS = "serving"
LABELS = {
    "prefill": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "prefill"},
    "decode": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "decode"},
}


class FakeAPI:
    """Two Deployments (pdserve-prefill, pdserve-decode) with pods at known IPs; records calls."""

    def __init__(self) -> None:
        self.replicas = {"pdserve-prefill": 1, "pdserve-decode": 2}
        self.pods = {
            "pdserve-prefill": [("prefill-a", "10.0.0.5")],
            "pdserve-decode": [("decode-a", "10.0.0.7"), ("decode-b", "10.0.0.8")],
        }
        self.annotations: dict[str, dict] = {}
        self.calls: list[tuple[str, str, dict | None]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, body: dict, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                url = urlsplit(self.path)
                api.calls.append((self.command, url.path + ("?" + url.query if url.query else ""), body))
                self._reply(*api.answer(self.command, url.path, parse_qs(url.query), body))

            do_GET = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, method: str, path: str, query: dict, body: dict | None) -> tuple[dict, int]:
        parts = path.strip("/").split("/")
        if parts[:5] == ["apis", "apps", "v1", "namespaces", NS] and parts[5] == "deployments":
            name = parts[6]
            if name not in self.replicas:
                return {"kind": "Status", "code": 404, "message": "not found"}, 404
            if parts[7:] == ["scale"]:
                if method == "PATCH":
                    self.replicas[name] = body["spec"]["replicas"]
                r = self.replicas[name]
                return {
                    "apiVersion": "autoscaling/v1",
                    "kind": "Scale",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"replicas": r},
                    "status": {"replicas": r},
                }, 200
            labels = LABELS[name.removeprefix("pdserve-")]
            return {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "namespace": NS},
                "spec": {
                    "replicas": self.replicas[name],
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {"containers": [{"name": "worker"}]},
                    },
                },
            }, 200
        if parts[:5] == ["api", "v1", "namespaces", NS, "pods"]:
            if method == "PATCH":
                self.annotations[parts[5]] = body["metadata"]["annotations"]
                return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": parts[5]}}, 200
            want = dict(kv.split("=") for kv in query["labelSelector"][0].split(","))
            name = next(
                n for n, labels in (("pdserve-" + r, lb) for r, lb in LABELS.items()) if labels == want
            )
            items = [
                {"metadata": {"name": p, "labels": want}, "status": {"podIP": ip}}
                for p, ip in self.pods[name]
            ]
            return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}, 200
        return {"kind": "Status", "code": 404, "message": f"no route {path}"}, 404

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def api(tmp_path, monkeypatch):
    fake = FakeAPI()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
                "users": [{"name": "ctl", "user": {"token": "t0ken"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "ctl", "namespace": NS}}
                ],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster: the kubeconfig
    yield fake
    fake.close()


def _worker(wid: str, role: str, ip: str) -> Worker:
    return Worker(wid, role, f"http://{ip}:8000", Breaker(5, 5.0))


def test_add_scales_the_pools_deployment_up(api):
    fleet = KubernetesFleet(ControllerConfig(namespace=NS))
    out = asyncio.run(fleet.add("prefill"))
    assert out == "deployment/pdserve-prefill replicas=2" and api.replicas["pdserve-prefill"] == 2
    assert [(m, p) for m, p, _ in api.calls] == [
        ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-prefill/scale"),
        ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-prefill/scale"),
    ]
    assert api.calls[1][2] == {"spec": {"replicas": 2}}
    # The new pod counts as starting until one more worker has registered.
    assert fleet.starting({"http://10.0.0.5:8000", "http://10.0.0.7:8000"}) == 1
    assert fleet.starting({"http://10.0.0.5:8000", "http://10.0.0.7:8000"}) == 1
    assert fleet.starting({"http://10.0.0.5:8000", "http://10.0.0.7:8000", "http://10.0.0.9:8000"}) == 0


def test_remove_marks_the_emptied_pod_then_scales_down(api):
    fleet = KubernetesFleet(ControllerConfig(namespace=NS))
    asyncio.run(fleet.remove(_worker("decode-b", "decode", "10.0.0.8")))
    assert api.annotations == {"decode-b": {DELETION_COST: "-1000"}}
    assert api.replicas == {"pdserve-prefill": 1, "pdserve-decode": 1}
    methods = [(m, p.split("?")[0].rsplit("/", 2)[-2:]) for m, p, _ in api.calls]
    # Marked before the scale-down, so that the ReplicaSet deletes this pod and not another.
    patch_pod = methods.index(("PATCH", ["pods", "decode-b"]))
    patch_scale = methods.index(("PATCH", ["pdserve-decode", "scale"]))
    assert patch_pod < patch_scale
    assert any(p.startswith(f"/api/v1/namespaces/{NS}/pods?labelSelector=") for _, p, _ in api.calls)


def test_a_switched_worker_is_removed_from_the_deployment_it_started_in(api):
    fleet = KubernetesFleet(ControllerConfig(namespace=NS))
    # The prefill Deployment's pod serves as a decode worker since a role switch.
    asyncio.run(fleet.remove(_worker("prefill-a", "decode", "10.0.0.5")))
    assert api.annotations == {"prefill-a": {DELETION_COST: "-1000"}}
    assert api.replicas == {"pdserve-prefill": 0, "pdserve-decode": 2}


def test_a_worker_with_no_pod_is_an_error_and_nothing_scales(api):
    fleet = KubernetesFleet(ControllerConfig(namespace=NS))
    with pytest.raises(RuntimeError, match="no pod"):
        asyncio.run(fleet.remove(_worker("stray", "decode", "10.9.9.9")))
    assert api.replicas == {"pdserve-prefill": 1, "pdserve-decode": 2} and not api.annotations


def _verb_of(method: str, path: str) -> tuple[str, str, str | None, str]:
    """(apiGroup, resource, name, verb) of a recorded call, as the API server authorizes it."""
    parts = urlsplit(path).path.strip("/").split("/")
    group = "apps" if parts[0] == "apis" else ""
    rest = parts[parts.index("namespaces") + 2 :]
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource += "/" + rest[2]
    verb = {"PATCH": "patch"}.get(method, "get" if name else "list")
    return group, resource, name, verb


def test_rbac_allows_every_call_the_controller_makes_and_the_hpas_target_the_pools(api):
    import yaml
    from deploy_assets import DEPLOY, manifests

    fleet = KubernetesFleet(ControllerConfig(namespace=NS))
    asyncio.run(fleet.add("decode"))
    asyncio.run(fleet.remove(_worker("prefill-a", "decode", "10.0.0.5")))
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "controller-rbac.yaml").read_text()))
    [role] = [d for d in docs if d["kind"] == "Role"]
    [binding] = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {s["name"] for s in binding["subjects"]} == {
        d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"
    }

    def allowed(group, resource, name, verb) -> bool:
        return any(
            group in r["apiGroups"]
            and resource in r["resources"]
            and verb in r["verbs"]
            and (("resourceNames" not in r) or (name is not None and name in r["resourceNames"]))
            for r in role["rules"]
        )

    calls = {_verb_of(m, p) for m, p, _ in api.calls}
    assert {c[3] for c in calls} == {"get", "list", "patch"}
    assert [c for c in calls if not allowed(*c)] == []
    # The HPAs scale the Deployments the main manifest defines, on a metric the router exports.
    deployments = {d["metadata"]["name"] for d in manifests() if d["kind"] == "Deployment"}
    hpas = list(yaml.safe_load_all((DEPLOY / "k8s" / "hpa.yaml").read_text()))
    assert (
        {h["spec"]["scaleTargetRef"]["name"] for h in hpas}
        == {"pdserve-prefill", "pdserve-decode"}
        <= deployments
    )
    metric = {m["external"]["metric"]["name"] for h in hpas for m in h["spec"]["metrics"]}
    assert metric == {"pdserve_controller_pressure"}
    assert {
        h["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]["pool"] for h in hpas
    } == {"prefill", "decode"}


def test_the_router_exports_the_pressure_with_the_controller_off():
    from fastapi.testclient import TestClient

    from pdserve.config import load_config
    from pdserve.router.gateway import create_router_app

    config = load_config(overrides={"model.name": "tiny-qwen2", "router.encoder_workers": 0})
    assert not config.controller.enabled
    text = TestClient(create_router_app(config)).get("/metrics").text
    assert "# TYPE pdserve_controller_pressure gauge" in text
    assert TestClient(create_router_app(config)).get("/admin/controller").json() == []
