"""The controller's hands on Kubernetes (controller.backend: kubernetes): scale the prefill and
decode pools' Deployments through the API with the official `kubernetes` client (pip install
'pdserve[kubernetes]'; RBAC in deploy/k8s/controller-rbac.yaml).

- add: the pool's Deployment scale goes up by one; the new pod registers itself with the router.
- remove: the controller has emptied the worker (control/role_switch.py empty_worker); its pod,
  found by IP among the Deployments' pods (after a role switch it may belong to the other pool's),
  gets the lowest `controller.kubernetes.io/pod-deletion-cost`, so that scaling its Deployment down
  by one deletes that pod and not a busy one.
The client's calls block, so they run in a thread.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pdserve.config import ControllerConfig

if TYPE_CHECKING:  # the router hands these in; at run time the control plane imports no router module
    from pdserve.router.registry import Worker

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
START_TIMEOUT_S = 600.0  # a pod that has not registered by then is no longer waited for


class KubernetesFleet:
    shares_cores = False  # pods with their own CPU requests

    def __init__(self, cc: ControllerConfig, api_client=None) -> None:
        """`api_client`: a kubernetes.client.ApiClient (None: the in-cluster config, else ~/.kube/config)."""
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                # KUBECONFIG read now: the client reads it once, when it is first imported.
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            api_client = client.ApiClient()
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = cc.namespace
        self.deployments = {"prefill": cc.prefill_deployment, "decode": cc.decode_deployment}
        self._pending: list[tuple[int, float]] = []  # (workers registered when added, give-up time)

    def _scale_by(self, role: str, delta: int) -> int:
        name = self.deployments[role]
        scale = self.apps.read_namespaced_deployment_scale(name, self.namespace)
        current = (scale.spec.replicas if scale.spec is not None else None) or 0
        replicas = max(0, current + delta)
        self.apps.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": replicas}})
        return replicas

    async def add(self, role: str, like: Worker | None = None) -> str:
        # The Deployment's pod template is the version its pods run (a rolling update sets it).
        replicas = await asyncio.to_thread(self._scale_by, role, 1)
        self._pending.append((-1, time.monotonic() + START_TIMEOUT_S))
        return f"deployment/{self.deployments[role]} replicas={replicas}"

    def starting(self, registered: set[str]) -> int:
        """Pods added and not yet registered: one fewer for each worker registered since the add."""
        now, n = time.monotonic(), len(registered)
        self._pending = [(at if at >= 0 else n, until) for at, until in self._pending if now < until]
        self._pending = [(at, until) for at, until in self._pending if n <= at]
        return len(self._pending)

    def _mark_and_scale_down(self, w: Worker) -> None:
        # A pod's Deployment is the pool it started in: after a role switch it may serve the other one.
        ip = urlsplit(w.url).hostname
        for role in (w.role, *(r for r in self.deployments if r != w.role)):
            name = self.deployments.get(role)
            if name is None:
                continue
            dep = self.apps.read_namespaced_deployment(name, self.namespace)
            labels = dep.spec.selector.match_labels or {}
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
            pod = next(
                (
                    p.metadata.name
                    for p in pods
                    if p.status is not None
                    and p.status.pod_ip == ip
                    and p.metadata is not None
                    and p.metadata.name
                ),
                None,
            )
            if pod is not None:
                self.core.patch_namespaced_pod(
                    pod, self.namespace, {"metadata": {"annotations": {DELETION_COST: "-1000"}}}
                )
                self._scale_by(role, -1)
                return
        raise RuntimeError(
            f"no pod of {sorted(self.deployments.values())} has the address {ip} of worker {w.worker_id!r}"
        )

    async def remove(self, w: Worker) -> None:
        await asyncio.to_thread(self._mark_and_scale_down, w)
