"""`pdserve serve` in PD mode: one router (this process) and prefill and decode worker processes.

Each worker gets the deployment's config as a file, its role, its ports, its thread count and its
CPU affinity. The router waits for the workers, serves, and on exit stops them (SIGTERM, then
SIGKILL after the shutdown timeout).
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
from pathlib import Path

from pdserve.config import Config, derive, for_role, shares_idle_cores
from pdserve.deployment_plan import pd_counts
from pdserve.worker_process import WorkerProcess, write_worker_config

log = logging.getLogger(__name__)


def instance_counts(config: Config) -> tuple[int, int]:
    """(prefill, decode) workers: deployment.<role>.instances, else from deployment.pd_ratio (deployment_plan.py)."""
    n_prefill, n_decode, _ = pd_counts(config)
    return n_prefill, n_decode


def start_workers(config: Config, log_dir: Path) -> list[WorkerProcess]:
    n_prefill, n_decode = instance_counts(config)
    if n_decode < 1:
        raise ValueError("a PD deployment needs at least one decode worker")
    # Workers of a one-machine deployment talk to the router and each other over loopback only;
    # the router alone listens on server.host (0.0.0.0 in a container must not expose workers).
    host = "127.0.0.1"
    config_file = write_worker_config(config, log_dir / "deployment.yaml")
    # Each worker applies its role's settings (deployment.<role>) itself, from the file; the launcher
    # needs its threads (OpenMP reads them from the environment) and cores.
    # Decode workers learn prefill workers from the router (which names one per request).
    return [
        WorkerProcess(
            role,
            i,
            config_file,
            host,
            for_role(config, role).server.threads,
            getattr(config.deployment, role).cpu_affinity,
            log_dir,
            [],
            shares_idle_cores(config),
        )
        for role, n in (("prefill", n_prefill), ("decode", n_decode))
        for i in range(n)
    ]


def wait_healthy(workers: list[WorkerProcess], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        for w in list(pending):
            if w.proc.poll() is not None:
                raise RuntimeError(
                    f"{w.role} worker exited with {w.proc.returncode}; log: {w.log_path}\n"
                    + w.log_path.read_text(errors="replace")[-2000:]
                )
            if w.healthy():
                pending.remove(w)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers not healthy after {timeout:.0f}s: {[w.log_path for w in pending]}")
        time.sleep(0.3)


def _local_controller(config: Config) -> bool:
    return config.controller.enabled and config.controller.backend == "local"


def _keyed(config: Config) -> bool:
    from pdserve.router.access import KeyStore

    return (
        KeyStore(config.router.api_keys).enabled
        or KeyStore(config.router.admin_keys, "PDSERVE_ADMIN_KEYS").enabled
    )


def _local_fleet(config: Config, workers: list[WorkerProcess], log_dir: Path):
    """The router's way to start and stop this deployment's workers: the controller's (unless it
    scales Kubernetes Deployments instead) and a rollout's (control/rollout_api.py)."""
    if config.controller.enabled and not _local_controller(config):
        return None
    from pdserve.control.local_fleet import LocalFleet

    host = config.server.host if config.server.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    scheme = "https" if config.router.tls_cert else "http"
    return LocalFleet(
        config, workers, log_dir / "deployment.yaml", log_dir, f"{scheme}://{host}:{config.server.port}"
    )


def serve_pd(config: Config, sock=None) -> None:
    from pdserve.router.gateway import create_router_app
    from pdserve.server.serving import run_uvicorn

    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-"))
    if (
        _local_controller(config)
        and _keyed(config)
        and not (config.server.internal_token or os.environ.get("PDSERVE_INTERNAL_TOKEN"))
    ):
        # Workers the controller starts register themselves, which takes the internal token once the
        # router has keys; the router and every worker (started with this environment) share one.
        # Without keys none is made: a token closes the admin API to all but admin keys.
        os.environ["PDSERVE_INTERNAL_TOKEN"] = secrets.token_hex(16)
    workers = start_workers(config, log_dir)
    log.info("worker logs in %s", log_dir)
    try:
        wait_healthy(workers)
        config = derive(
            config,
            {"router.workers": [*config.router.workers, *({"url": w.url, "role": w.role} for w in workers)]},
        )
        app = create_router_app(config, _local_fleet(config, workers, log_dir))
        log.info(
            "serving %s on http://%s:%d (%d prefill, %d decode workers)",
            config.model.name,
            config.server.host,
            config.server.port,
            *instance_counts(config),
        )
        run_uvicorn(app, config, tls=True, sock=sock)
    finally:
        # Decode workers drain first: their requests still loading need the prefill workers.
        for role in ("decode", "prefill"):
            group = [w for w in workers if w.role == role]
            for w in group:
                w.stop()
            for w in group:
                w.wait(config.server.shutdown_timeout_s)
