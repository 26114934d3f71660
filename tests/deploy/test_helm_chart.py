"""The Helm chart deploy/helm/pdserve, rendered by Helm's own template engine (the Go SDK in the
helm-python-sdk wheel, offline) with each of its value sets (laptop; PD with HPAs, a ServiceMonitor
and an InferencePool; EP workers as LeaderWorkerSets): helm lint passes, every object validates
against Kubernetes' schemas (kubernetes-validate) or, for custom resources, against schemas written
from their CRDs (crd_schemas.yaml), and the objects are wired to each other and to pdserve: the
secrets they reference exist, Services select their pods, probes and the preStop drain call routes
pdserve serves, and every process's arguments and config file load with pdserve's own loader.
The processes themselves run in test_chart_e2e.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_assets import DEPLOY, VALUE_SETS, chart_objects, chart_values, render_module
from fastapi import FastAPI

from pdserve.cli import _overrides, build_parser
from pdserve.config import load_config
from pdserve.deployment_plan import make_plan
from pdserve.model.ep_remote import check_rank, host_ranks
from pdserve.protocol import INTERNAL_TOKEN_HEADER
from pdserve.protocol.control import LeaveRequest
from pdserve.server.internal_api import OPEN_PATHS
from pdserve.server.role_switch import install_role_route

CHART = DEPLOY / "helm" / "pdserve"
K8S_VERSION = "1.30"  # the oldest Kubernetes the chart is for (autoscaling/v2, policy/v1)
CRDS = yaml.safe_load((Path(__file__).parent / "crd_schemas.yaml").read_text())["kinds"]
WORKLOADS = ("Deployment", "LeaderWorkerSet")
SECRET_KEYS = {"internal-token", "api-keys", "admin-keys", "worker-api-keys"}


@pytest.fixture(scope="module", params=VALUE_SETS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, chart_objects(request.param)


def _pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        t = obj["spec"]["leaderWorkerTemplate"]
        # The leader's first: with EP over several pods it runs the worker, the others its ranks.
        return [*([t["leaderTemplate"]] if "leaderTemplate" in t else []), t["workerTemplate"]]
    return []


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def _matches(selector: dict, obj: dict) -> bool:
    """A label selector (matchLabels and matchExpressions) against an object's labels."""
    labels = obj["metadata"].get("labels", {})
    ops = {
        "In": lambda k, vs: labels.get(k) in vs,
        "NotIn": lambda k, vs: labels.get(k) not in vs,
        "Exists": lambda k, vs: k in labels,
        "DoesNotExist": lambda k, vs: k not in labels,
    }
    return _selects(selector.get("matchLabels", {}), labels) and all(
        ops[e["operator"]](e["key"], e.get("values", [])) for e in selector.get("matchExpressions", [])
    )


def _workload(objs: list[dict], component: str) -> dict:
    [w] = [
        o
        for o in objs
        if o["kind"] in WORKLOADS and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return w


def _container(w: dict) -> dict:
    [c] = _pod_templates(w)[0]["spec"]["containers"]
    return c


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_passes(value_set):
    report = helm_python.lint(CHART, chart_values(value_set), strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_every_object_validates_against_its_schema(rendered):
    value_set, objs = rendered
    kinds = {o["kind"] for o in objs}
    assert {"ConfigMap", "Service"} <= kinds and kinds & set(WORKLOADS)
    expected = {
        "laptop": {"Secret", "Deployment"},
        "pd-hpa": {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor", "InferencePool"},
        "ep": {"LeaderWorkerSet", "ServiceMonitor", "PodDisruptionBudget", "Secret"},
    }[value_set]
    assert expected <= kinds, kinds
    for obj in objs:
        key = f"{obj['apiVersion']}/{obj['kind']}"
        if key in CRDS:
            jsonschema.validate(obj, CRDS[key])
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        for i, template in enumerate(_pod_templates(obj) if obj["kind"] != "Deployment" else []):
            pod = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"t{i}"},
                "template": template,
            }
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_a_schema_refuses_a_wrong_field():
    """The validators can fail: a misspelt field of a core kind and of a custom resource."""
    objs = chart_objects("pd-hpa")
    dep = json.loads(json.dumps(_workload(objs, "decode")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    [pool] = [o for o in objs if o["kind"] == "InferencePool"]
    pool["spec"]["targetPortNumber"] = 8000  # the field of an older version of the CRD
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, CRDS[f"{pool['apiVersion']}/InferencePool"])


def test_secrets_services_and_selectors_are_wired(rendered):
    value_set, objs = rendered
    values = chart_values(value_set)
    existing = values.get("secrets", {}).get("existingSecret")
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    assert bool(existing) != bool(secrets)  # from an existing Secret, or one created from the values
    workloads = [o for o in objs if o["kind"] in WORKLOADS]
    pods = [(w, t) for w in workloads for t in _pod_templates(w)]
    for w, t in pods:
        if "selector" in w["spec"]:  # a LeaderWorkerSet selects its own pods
            assert _selects(w["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])
        for c in t["spec"]["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                assert ref["key"] in SECRET_KEYS
                if existing:
                    assert ref["name"] == existing
                else:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (ref, w["metadata"]["name"])
            for m in c.get("volumeMounts", []):
                assert m["name"] in {v["name"] for v in t["spec"]["volumes"]}
            config_maps = {v["configMap"]["name"] for v in t["spec"]["volumes"] if "configMap" in v}
            assert config_maps <= {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
    for svc in (o for o in objs if o["kind"] == "Service"):
        selected = [(w, t) for w, t in pods if _selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert len({w["metadata"]["name"] for w, _ in selected}) == 1, svc["metadata"][
            "name"
        ]  # one component
        ports = {p["name"] for c in selected[0][1]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, svc["metadata"]["name"]
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        assert any(_selects(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"]) for _, t in pods)
    for hpa in (o for o in objs if o["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        [target] = [w for w in workloads if w["kind"] == ref["kind"] and w["metadata"]["name"] == ref["name"]]
        assert "replicas" not in target["spec"]  # the HPA owns the count
        [m] = hpa["spec"]["metrics"]
        assert m["external"]["metric"]["name"] == "pdserve_controller_pressure"
        assert (
            m["external"]["metric"]["selector"]["matchLabels"]["pool"]
            == target["metadata"]["labels"]["app.kubernetes.io/component"]
        )
    for sm in (o for o in objs if o["kind"] == "ServiceMonitor"):
        monitored = [o for o in objs if o["kind"] == "Service" and _matches(sm["spec"]["selector"], o)]
        components = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in monitored}
        assert components == {"router", "prefill", "decode"}
        assert all(e["path"] == "/metrics" and e["port"] == "http" for e in sm["spec"]["endpoints"])
    for pool in (o for o in objs if o["kind"] == "InferencePool"):
        [(w, t)] = [
            (w, t)
            for w, t in pods
            if _selects(pool["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])
        ]
        c = _container(w)
        assert pool["spec"]["targetPorts"][0]["number"] in {
            p["containerPort"] for p in c["ports"] if p["name"] == "http"
        }
        assert "PDSERVE_WORKER_API_KEYS" in {e["name"] for e in c["env"]}  # the picker's key reaches /v1
        assert pool["spec"]["endpointPickerRef"]["name"]


def _config_file(objs: list[dict], tmp_path: Path) -> Path:
    [cm] = [o for o in objs if o["kind"] == "ConfigMap"]
    path = tmp_path / "pdserve.yaml"
    path.write_text(cm["data"]["pdserve.yaml"])
    return path


def test_processes_run_commands_and_config_pdserve_accepts(rendered, tmp_path):
    value_set, objs = rendered
    values = chart_values(value_set)
    cfg_file = _config_file(objs, tmp_path)
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    source = "\n".join(p.read_text() for p in (DEPLOY.parent / "pdserve").rglob("*.py"))
    app = FastAPI()
    install_role_route(app, None)  # registers the routes only
    worker_routes = {r.path for r in app.routes}
    roles = set()
    for w in (o for o in objs if o["kind"] in WORKLOADS):
        c = _container(w)
        args = build_parser().parse_args(c["args"])  # exits on a flag pdserve does not have
        role = args.role if args.command == "worker" else None
        config = load_config(str(cfg_file), _overrides(args), role=role)  # ConfigError on a bad key
        http = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert config.server.host == "0.0.0.0" and config.server.port == http["http"]
        for env in c.get("env", []):
            assert env["name"] in source, f"{env['name']} is read nowhere in pdserve"
        # Probes read pages a pod answers without credentials (a worker gates every other route).
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["path"] in OPEN_PATHS and c[probe]["httpGet"]["port"] in http
        assert c["readinessProbe"] != c["livenessProbe"]
        assert config.model.name == values.get("model", {}).get("name", "smollm2-135m")
        if args.command != "worker":
            assert args.command == "router"
            assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"  # not ready without workers, yet alive
            continue
        roles.add(role)
        assert config.worker.kv_port in http.values()
        role_values = values.get(role, {})
        assert config.model.expert_parallel == role_values.get("expertParallel", 1)
        if role_values.get("quantization"):
            assert config.model.quantization == role_values["quantization"]
        # The preStop drain: POST /internal/leave on this pod with the internal token, a body the
        # route accepts, a deadline, and time left before SIGKILL for the shutdown after it.
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python", "-c"]
        code = command[2]
        url = re.search(r"'(http://[^']+)'", code).group(1)
        assert url == f"http://127.0.0.1:{http['http']}/internal/leave" and "/internal/leave" in worker_routes
        body = LeaveRequest.model_validate_json(re.search(r"data=b'([^']+)'", code).group(1))
        assert f"'{INTERNAL_TOKEN_HEADER}': os.environ['PDSERVE_INTERNAL_TOKEN']" in code
        grace = _pod_templates(w)[0]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= body.drain_timeout_s + config.server.shutdown_timeout_s
        # Workers register with every router replica through the headless Service.
        host = re.match(r"http://([^:/]+):(\d+)$", config.server.router_url)
        svc = services[host.group(1)]
        assert svc["spec"].get("publishNotReadyAddresses") and svc["spec"]["clusterIP"] == "None"
        router = _workload(objs, "router")
        assert _selects(svc["spec"]["selector"], _pod_templates(router)[0]["metadata"]["labels"])
        assert int(host.group(2)) in {p["port"] for p in svc["spec"]["ports"]}
        assert any(e["name"] == "PDSERVE_ADVERTISE_HOST" for e in c["env"])
    assert roles == {"prefill", "decode"}


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) in a container's args, as Kubernetes expands them from the container's environment."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_ep_over_several_pods_runs_every_rank_once(tmp_path, monkeypatch):
    """A LeaderWorkerSet group of podsPerGroup pods: the leader's worker starts its pod's ranks and
    serves the rendezvous on a port its container declares; each other pod's `pdserve ep-rank
    --pod-index` runs the next ranks; together they are every rank once, with the config and the
    internal token the leader has."""
    objs = chart_objects("ep")
    cfg_file = _config_file(objs, tmp_path)
    [secret] = [o for o in objs if o["kind"] == "Secret"]
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", secret["stringData"]["internal-token"])  # as the pods get it
    groups = [
        o
        for o in objs
        if o["kind"] == "LeaderWorkerSet" and "leaderTemplate" in o["spec"]["leaderWorkerTemplate"]
    ]
    assert groups, "the ep value set spreads a worker's ranks over pods"
    for w in groups:
        size = w["spec"]["leaderWorkerTemplate"]["size"]
        leader, other = _pod_templates(w)
        env = {
            "LWS_LEADER_ADDRESS": f"{w['metadata']['name']}-0.{w['metadata']['name']}",
            "LWS_WORKER_INDEX": "0",
        }
        [lc] = leader["spec"]["containers"]
        args = build_parser().parse_args(_expand(lc["args"], env))
        config = load_config(str(cfg_file), _overrides(args), role=args.role)
        world, local = config.model.expert_parallel, config.model.ep_local_ranks
        assert args.command == "worker" and local * size == world
        host, port = config.model.ep_rendezvous.rsplit(":", 1)
        assert host == env["LWS_LEADER_ADDRESS"]
        assert int(port) in {p["containerPort"] for p in lc["ports"] if p["name"] == "ep-rendezvous"}
        ranks = list(range(local))
        [rc] = other["spec"]["containers"]
        assert "ports" not in rc and not _selects(leader["metadata"]["labels"], other["metadata"]["labels"])
        for index in range(1, size):
            r_args = build_parser().parse_args(_expand(rc["args"], {**env, "LWS_WORKER_INDEX": str(index)}))
            r_config = load_config(str(cfg_file), _overrides(r_args), role=r_args.role)
            assert r_args.command == "ep-rank" and r_args.role == args.role
            assert r_config.model == config.model  # the same model, ranks and rendezvous as the leader's
            mine = host_ranks(r_config, r_args.pod_index)
            assert all(check_rank(r_config, r) is None for r in mine)
            ranks += mine
        assert ranks == list(range(world))

        def secrets(c: dict) -> dict:
            return {
                e["name"]: e["valueFrom"]["secretKeyRef"]
                for e in c["env"]
                if "secretKeyRef" in e.get("valueFrom", {})
            }

        assert secrets(rc) == {"PDSERVE_INTERNAL_TOKEN": secrets(lc)["PDSERVE_INTERNAL_TOKEN"]}


def test_the_deployment_plan_fits_the_model(rendered, tmp_path):
    """What `pdserve serve --dry-run` checks against the model (read without its weights): the EP set's
    ranks need a MoE model with enough expert slots (a tiny random one stands in for the volume's)."""
    value_set, objs = rendered
    override = {"model.name": "tiny-qwen3-moe"} if value_set == "ep" else {}
    plan = make_plan(load_config(str(_config_file(objs, tmp_path)), override))
    values = chart_values(value_set)
    assert {rp.role: rp.expert_parallel for rp in plan.roles} == {
        role: values.get(role, {}).get("expertParallel", 1) for role in ("prefill", "decode")
    }


def test_the_router_gets_every_key_the_workers_only_the_token(rendered):
    _, objs = rendered

    def refs(component: str) -> dict[str, str]:
        c = _container(_workload(objs, component))
        return {
            e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
            for e in c["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }

    router = refs("router")
    assert router == {
        "PDSERVE_INTERNAL_TOKEN": "internal-token",
        "PDSERVE_API_KEYS": "api-keys",
        "PDSERVE_ADMIN_KEYS": "admin-keys",
    }
    for role in ("prefill", "decode"):
        assert (
            refs(role).items()
            <= {
                "PDSERVE_INTERNAL_TOKEN": "internal-token",
                "PDSERVE_WORKER_API_KEYS": "worker-api-keys",
            }.items()
        )
        assert refs(role)["PDSERVE_INTERNAL_TOKEN"] == router["PDSERVE_INTERNAL_TOKEN"]


def test_the_controller_gets_its_account_and_the_names_of_the_pools(tmp_path):
    objs = render_module().render(
        render_module().merge(chart_values("laptop"), {"controller": {"enabled": True}}), namespace="serving"
    )
    config = load_config(str(_config_file(objs, tmp_path)))
    assert config.controller.enabled and config.controller.backend == "kubernetes"
    assert config.controller.namespace == "serving"
    deployments = {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"}
    assert {config.controller.prefill_deployment, config.controller.decode_deployment} <= deployments
    [role] = [o for o in objs if o["kind"] == "Role"]
    assert set(role["rules"][0]["resourceNames"]) == {
        config.controller.prefill_deployment,
        config.controller.decode_deployment,
    }
    router = _workload(objs, "router")
    [sa] = [o for o in objs if o["kind"] == "ServiceAccount"]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


@pytest.mark.parametrize(
    "override, named",
    [
        ({"secrets": {"internalToken": ""}}, "secrets.internalToken"),
        ({"secrets": {"adminKeys": []}}, "secrets.adminKeys"),
        ({"inferencePool": {"enabled": True}}, "secrets.workerApiKeys"),
        ({"decode": {"podsPerGroup": 2}}, "decode.podsPerGroup"),
        (
            {"decode": {"workload": "LeaderWorkerSet", "expertParallel": 3, "podsPerGroup": 2}},
            "decode.podsPerGroup",
        ),
        ({"prefill": {"workload": "StatefulSet"}}, "prefill.workload"),
        ({"prefill": {"workload": "LeaderWorkerSet"}, "controller": {"enabled": True}}, "prefill.workload"),
    ],
)
def test_bad_values_stop_the_render_naming_the_key(override, named):
    values = render_module().merge(chart_values("laptop"), override)
    with pytest.raises(helm_python.HelmError, match=re.escape(named)):
        render_module().render(values)


def test_the_plain_manifests_are_the_charts_render():
    assert render_module().main(["--check"]) == 0, "run python deploy/render.py"
