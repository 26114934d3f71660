"""deploy/: the Kubernetes manifests start processes our CLI and config accept, wired to each
other; every metric the alert rules and the dashboard query is one pdserve exports (the names a
real PD deployment serves are checked in tests/disagg/test_pd_server.py)."""

from __future__ import annotations

import re

import yaml
from deploy_assets import DEPLOY, manifests, referenced_metrics

from pdserve.cli import _overrides, build_parser
from pdserve.config import load_config


def test_manifests_run_commands_the_cli_and_config_accept(tmp_path):
    docs = manifests()
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    cfg_file = tmp_path / "pdserve.yaml"
    cfg_file.write_text(config_map["data"]["pdserve.yaml"])
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    roles = set()
    source = "\n".join(p.read_text() for p in (DEPLOY.parent / "pdserve").rglob("*.py"))
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        [c] = dep["spec"]["template"]["spec"]["containers"]
        args = build_parser().parse_args(c["args"])  # exits on a flag we do not have
        config = load_config(str(cfg_file), _overrides(args))
        ports = {p["containerPort"] for p in c["ports"]}
        assert config.server.host == "0.0.0.0" and config.server.port in ports
        assert (
            dep["spec"]["selector"]["matchLabels"].items()
            <= dep["spec"]["template"]["metadata"]["labels"].items()
        )
        for env in c.get("env", []):
            assert env["name"] in source, f"{env['name']} is read nowhere in pdserve"
        if args.command == "worker":
            roles.add(args.role)
            assert args.kv_port in ports
            host = re.match(r"http://([^:/]+):(\d+)", args.router_url)
            svc = services[host.group(1)]
            [router] = [
                d for d in docs if d["metadata"]["name"] == "pdserve-router" and d["kind"] == "Deployment"
            ]
            assert svc["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
            assert int(host.group(2)) in {p["port"] for p in svc["spec"]["ports"]}
            assert svc["spec"].get(
                "publishNotReadyAddresses"
            )  # the router is not ready before workers register
            assert any(e["name"] == "PDSERVE_ADVERTISE_HOST" for e in c["env"])
    assert roles == {"prefill", "decode"}


def test_rules_and_dashboard_query_pdserve_metrics():
    names = referenced_metrics()
    assert {
        "pdserve_router_worker_healthy",
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_kv_cache_usage_ratio",
    } <= names
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    for r in (r for g in rules["groups"] for r in g["rules"]):
        assert r["alert"].startswith("Pdserve") and r["labels"]["severity"] in ("critical", "warning", "info")
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())
    targets = {c.get("target_label") for c in scrape["scrape_configs"][0]["relabel_configs"]}
    assert {"component", "pod"} <= targets  # the labels the rules and the dashboard group by


def test_the_router_has_admin_keys_and_shares_the_internal_token_with_its_workers():
    """Workers register with the router's internal token; /admin/* takes only admin keys
    (the processes themselves run in test_chart_e2e.py)."""

    def secrets(component: str) -> dict[str, str]:
        [dep] = [
            d
            for d in manifests()
            if d["kind"] == "Deployment"
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
        ]
        [c] = dep["spec"]["template"]["spec"]["containers"]
        return {
            e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
            for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }

    router = secrets("router")
    assert {"PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEYS", "PDSERVE_INTERNAL_TOKEN"} <= set(router)
    assert router["PDSERVE_ADMIN_KEYS"] != router["PDSERVE_API_KEYS"]
    for role in ("prefill", "decode"):
        assert secrets(role) == {"PDSERVE_INTERNAL_TOKEN": router["PDSERVE_INTERNAL_TOKEN"]}  # no client keys
