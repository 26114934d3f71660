"""Render the Helm chart deploy/helm/pdserve offline, and write the plain manifests in deploy/k8s from it.

    python deploy/render.py                 # rewrite deploy/k8s/*.yaml from the chart
    python deploy/render.py --check         # exit 1 if they differ from a fresh render
    python deploy/render.py -f deploy/helm/pdserve/ci/laptop-values.yaml   # print one render

Rendering uses Helm's own template engine (the Go SDK, compiled into the `helm-python-sdk` wheel),
so no helm binary or cluster is needed; `helm template` gives the same objects.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
CHART = DEPLOY / "helm" / "pdserve"
K8S = DEPLOY / "k8s"
RELEASE, NAMESPACE = "pdserve", "default"
_SEP = re.compile(r"^---\s*$", re.M)


def merge(base: dict, over: dict) -> dict:
    """Helm's coalescing of values files: maps merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = (
            merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        )
    return out


def load_values(*files: str | Path, extra: dict | None = None) -> dict:
    values: dict = {}
    for f in files:
        values = merge(values, yaml.safe_load(Path(f).read_text()) or {})
    return merge(values, extra or {})


def render_documents(
    values: dict | None = None, release: str = RELEASE, namespace: str = NAMESPACE
) -> list[str]:
    """The chart's manifests as YAML documents (comments kept), in template order, NOTES left out."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values=values or {}, name=release, namespace=namespace)
    docs = []
    for path in sorted(rendered):
        if path.endswith("NOTES.txt"):
            continue
        for doc in _SEP.split(rendered[path]):
            body = "\n".join(line.rstrip() for line in doc.strip("\n").splitlines())
            if yaml.safe_load(body):
                docs.append(body)
    return docs


def render(values: dict | None = None, release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    """The chart's objects, parsed."""
    return [yaml.safe_load(d) for d in render_documents(values, release, namespace)]


HEADER = """\
# Generated from the Helm chart deploy/helm/pdserve by `python deploy/render.py` (values: {values});
# edit the chart, not this file (tests/deploy/test_helm_chart.py checks they agree).
"""
MANIFESTS = {
    # file: (values beside the chart's defaults, the kinds taken, what the file is for)
    "pdserve.yaml": (
        {"secrets": {"existingSecret": "pdserve-secrets"}},
        None,
        """\
# A PD deployment of pdserve: two router replicas, prefill and decode workers that register
# themselves with every router (the headless Service pdserve-router-internal resolves to all router
# pods), each worker advertising its pod IP. The secrets come from a Secret you create:
#   kubectl create secret generic pdserve-secrets --from-literal=internal-token="$(openssl rand -hex 16)" \\
#     --from-literal=api-keys=sk-client-1,sk-client-2 --from-literal=admin-keys="sk-admin-$(openssl rand -hex 16)"
#   kubectl apply -f deploy/k8s/pdserve.yaml
# Clients use an API key; /admin/* takes only an admin key; workers register with the internal
# token; /health and /metrics stay open for probes and Prometheus. A deleted worker pod drains in
# its preStop hook (POST /internal/leave), then finishes on SIGTERM.
""",
    ),
    "hpa.yaml": (
        {"secrets": {"existingSecret": "pdserve-secrets"}, "autoscaling": {"enabled": True}},
        {"HorizontalPodAutoscaler"},
        """\
# HorizontalPodAutoscalers for the two pools, for clusters that scale with an HPA instead of the
# router's own controller (leave controller.enabled false; the router exports the figures anyway).
# The metric is the router's pdserve_controller_pressure{pool=...}: the pool's latency over its SLO
# (prefill: TTFT p90 / controller.slo_ttft_ms; decode: the larger of ITL p90 / controller.slo_tpot_ms
# and KV usage / controller.kv_usage_high), 1.0 at the SLO. It reaches the HPA as an external metric
# through prometheus-adapter, e.g. with the rule:
#   - seriesQuery: 'pdserve_controller_pressure{pool!=""}'
#     metricsQuery: 'max(<<.Series>>{<<.LabelMatchers>>}) by (pool)'
# A scale-down's pod drains in its preStop hook (its requests move to other workers), then finishes
# on SIGTERM within terminationGracePeriodSeconds; keep scaleDown slow. Delete the Deployments'
# `replicas` (kubectl apply of pdserve.yaml sets them) or install the chart with autoscaling.enabled.
""",
    ),
    "controller-rbac.yaml": (
        {"secrets": {"existingSecret": "pdserve-secrets"}, "controller": {"rbac": True}},
        {"ServiceAccount", "Role", "RoleBinding"},
        """\
# RBAC for the autoscaler in the router (controller.enabled: true, controller.backend: kubernetes;
# pdserve/control/k8s_fleet.py). Run the router's Deployment with `serviceAccountName:
# pdserve-controller` to use it (the chart's controller.enabled does both).
# tests/control/test_k8s_fleet.py checks every call the controller makes against these rules.
""",
    ),
}


def manifest_text(file: str) -> str:
    values, kinds, about = MANIFESTS[file]
    docs = [d for d in render_documents(values) if kinds is None or yaml.safe_load(d)["kind"] in kinds]
    return (
        HEADER.format(values=yaml.safe_dump(values, default_flow_style=True).strip())
        + about
        + ("---\n".join(d + "\n" for d in docs))
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if deploy/k8s differs from a fresh render")
    p.add_argument("-f", "--values", action="append", default=[], help="print the render with these values")
    args = p.parse_args(argv)
    if args.values:
        print("---\n".join(d + "\n" for d in render_documents(load_values(*args.values))), end="")
        return 0
    stale = []
    for file in MANIFESTS:
        text, path = manifest_text(file), K8S / file
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(DEPLOY.parent)))
        else:
            path.write_text(text)
    if stale:
        print("out of date (run python deploy/render.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
