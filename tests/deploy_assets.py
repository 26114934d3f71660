"""The deploy/ assets, read for tests: the manifests, the Helm chart's renders and the metric names rules
and dashboard query."""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
METRIC = re.compile(r"\bpdserve_[a-z0-9_]+")


def manifests() -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "pdserve.yaml").read_text()) if d]


@cache
def render_module():
    """deploy/render.py (deploy/ is no package): renders the chart with Helm's template engine."""
    spec = importlib.util.spec_from_file_location("pdserve_deploy_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VALUE_SETS = ("laptop", "pd-hpa", "ep")  # deploy/helm/pdserve/ci/<name>-values.yaml


def chart_values(value_set: str) -> dict:
    return render_module().load_values(DEPLOY / "helm" / "pdserve" / "ci" / f"{value_set}-values.yaml")


def chart_objects(value_set: str) -> list[dict]:
    """The chart rendered with one of its value sets (release pdserve, namespace default)."""
    return render_module().render(chart_values(value_set))


def referenced_metrics() -> set[str]:
    """Every pdserve_* series name the alert rules and the Grafana dashboard query."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return {m for e in exprs for m in METRIC.findall(e)}


def exported_metrics(exposition: str) -> set[str]:
    """The series names a /metrics page can serve, from its families: counters as name_total,
    histograms as name_bucket/_sum/_count (a labelled family with no sample yet counts too)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: set[str] = set()
    for fam in text_string_to_metric_families(exposition):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
        out.update(fam.name + s for s in suffixes)
    return out
