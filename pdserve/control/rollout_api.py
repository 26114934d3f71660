"""The router's side of a rollout: the admin routes `pdserve rollout` (control/rollout.py) drives.

- `GET|PUT|DELETE /admin/canary`: `{"version": V, "weight": W}` sends a share W of new requests to
  workers of version V first (router/policies.py canary_pool); the rest go to the other versions.
- `POST /admin/workers` (`StartWorker`): the router's fleet starts a worker of a role running a
  config, or a version it ran before (a rollback); the router adds it once it answers /health.
- `POST /admin/workers/{id}/retire`: no new work, its requests finish or move to other workers
  (as a scale-down: role_switch.empty_worker), then the fleet stops it and the router forgets it.

Only a router that can start workers takes the last two (`pdserve serve`: pdserve/control/local_fleet.py);
elsewhere they answer 501 (on Kubernetes a Deployment's rolling update replaces pods).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from fastapi import FastAPI

from pdserve.config import Config, ConfigError
from pdserve.control.role_switch import SwitchRefused, back_into_service, empty_worker
from pdserve.protocol.control import CanarySetting, LeaveRequest, StartWorker
from pdserve.server.errors import error_response

if TYPE_CHECKING:  # the router hands these in; at run time the control plane imports no router module
    from pdserve.router.backend import RemoteBackend
    from pdserve.router.registry import Registry, Worker

log = logging.getLogger(__name__)
REGISTRATION_WAIT_S = 15.0  # for a started worker's own registration, before the router adds it itself


class RolloutFleet(Protocol):
    """What a fleet needs for rollouts (pdserve/control/local_fleet.py LocalFleet has it)."""

    def write_config(self, data: dict) -> tuple[Path, Config]: ...

    def version_file(self, version: str) -> Path | None: ...

    async def remember(self, w: Worker) -> None: ...

    async def start(self, role: str, config_file: Path, timeout_s: float, near: str | None = None) -> str: ...

    async def remove(self, w: Worker) -> None: ...


def _no_fleet() -> Any:
    return error_response(
        501,
        "this router cannot start or stop workers (run the deployment with `pdserve serve`; "
        "on Kubernetes roll the Deployments)",
        code="no_fleet",
    )


def install_rollout_routes(
    app: FastAPI,
    config: Config,
    registry: Registry,
    client: httpx.AsyncClient,
    backend: RemoteBackend,
    fleet: Any,
) -> None:
    can_start = all(hasattr(fleet, m) for m in ("write_config", "version_file", "remember", "start"))
    rfleet: RolloutFleet | None = fleet if can_start else None

    def canary() -> dict:
        c = backend.canary
        return {"version": c.version if c else None, "weight": c.weight if c else None}

    @app.get("/admin/canary")
    async def get_canary():
        return canary()

    @app.put("/admin/canary")
    async def set_canary(body: CanarySetting):
        backend.set_canary(body.version, body.weight)
        log.info("canary: %.0f%% of new requests to version %s first", body.weight * 100, body.version)
        return canary()

    @app.delete("/admin/canary")
    async def clear_canary():
        backend.canary = None
        return canary()

    @app.post("/admin/workers", status_code=201)
    async def start_worker(body: StartWorker):
        if rfleet is None:
            return _no_fleet()
        if (body.config is None) == (body.version is None):
            return error_response(
                400,
                "give one of config (a config mapping) or version (one this fleet ran)",
                "config",
                "invalid_value",
            )
        if body.config is not None:
            try:
                path, new = rfleet.write_config(body.config)
            except ConfigError as e:
                return error_response(
                    400, "; ".join(f"{k}: {p}" for k, p in e.problems), "config", "invalid_value"
                )
            if new.model.name != config.model.name:
                return error_response(
                    409,
                    f"the config serves {new.model.name!r}, this router {config.model.name!r}; "
                    "a rollout keeps the model",
                    "config",
                    "model_mismatch",
                )
        else:
            found = rfleet.version_file(body.version or "")
            if found is None:
                return error_response(
                    404, f"this fleet never ran version {body.version!r}", "version", "unknown_version"
                )
            path = found
        timeout = body.timeout_s or config.rollout.health_timeout_s
        near = None
        if body.replaces is not None:
            old = registry.workers.get(body.replaces)
            near = old.url if old is not None else None
        try:
            url = await rfleet.start(body.role, path, timeout, near)
        except RuntimeError as e:
            return error_response(502, str(e), code="worker_unhealthy")
        # A worker that registers itself (one a host agent started) is not added twice: its
        # registration is waited for (briefly: it is sent as the worker starts serving).
        w = None
        deadline = time.monotonic() + (
            REGISTRATION_WAIT_S if getattr(rfleet, "workers_register", False) else 0
        )
        while True:
            w = next((x for x in registry.workers.values() if x.url == url.rstrip("/")), None)
            if w is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        if w is None:
            w = registry.add_static(url, body.role)
        await registry.check(client, w, time.monotonic())
        log.info("worker %s (%s, version %s) started at %s", w.worker_id, w.role, w.version, w.url)
        return w.describe()

    @app.post("/admin/workers/{worker_id}/retire")
    async def retire(worker_id: str, body: LeaveRequest):
        w = registry.workers.get(worker_id)
        if w is None:
            return error_response(404, f"no worker {worker_id!r}", code="unknown_worker")
        if rfleet is None:
            return _no_fleet()
        drain_s = (
            body.drain_timeout_s if body.drain_timeout_s is not None else config.controller.drain_timeout_s
        )
        try:
            try:
                moved = await empty_worker(registry, client, w, drain_s)
            except SwitchRefused as e:
                if e.code != "worker_failed" or w.healthy:
                    raise
                # Down (a new worker that died in its window): nothing to empty, the router has
                # moved its streams already (migration); the process is stopped all the same.
                log.warning("worker %s is down; retiring it without emptying: %s", worker_id, e)
                moved = 0
            await rfleet.remember(w)
            try:
                await rfleet.remove(w)
            except RuntimeError:
                if w.healthy:
                    raise
                # Down and unknown to the fleet (it died; a supervisor may run its successor
                # elsewhere): there is no process to stop, only the entry to forget.
                log.warning("worker %s is down and not in the fleet; forgotten", worker_id)
        except (SwitchRefused, RuntimeError) as e:
            await back_into_service(registry, client, w)  # still running (empty_worker undoes its own)
            status, code = (e.status, e.code) if isinstance(e, SwitchRefused) else (409, "not_in_fleet")
            return error_response(status, str(e), code=code)
        registry.deregister(worker_id)
        log.info("worker %s retired (%d requests moved)", worker_id, moved)
        return {"retired": worker_id, "moved": moved}
