"""One local worker process (`pdserve worker`) as `pdserve serve` and its local fleet start it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from pdserve.config import Config, derive
from pdserve.utils import core_share
from pdserve.utils.process import die_with_parent

# The router's secrets a worker has no use for: it takes the internal token, never a client or admin key.
ROUTER_SECRETS = ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEYS", "PDSERVE_ADMIN_KEY")


def write_worker_config(config: Config, path: Path) -> Path:
    """The config file a one-machine deployment's workers read: they listen on loopback only (the
    router alone listens on server.host) and publish KV events on free ports (shown in their /health).
    The router's client and admin keys are left out."""
    workers = derive(
        config,
        {
            "deployment.mode": "pd",
            "server.advertise_host": None,
            "cache.kv_events_endpoint": config.cache.kv_events_endpoint or "tcp://127.0.0.1:*",
            "router.api_keys": [],
            "router.admin_keys": [],
        },
    )
    path.write_text(yaml.safe_dump(workers.to_dict()))
    return path


def _preexec(cores: list[int] | None):
    def run() -> None:
        die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    return run


class WorkerProcess:
    def __init__(
        self,
        role: str,
        index: int,
        config_file: Path,
        host: str,
        threads: int,
        cpu_affinity: list[int] | None,
        log_dir: Path,
        extra: list[str],
        share_cores: bool = False,
    ) -> None:
        """`share_cores`: lend and borrow idle threads with the other workers started with it and the
        same log_dir (utils/core_share.py); not for a worker pinned to its own cores."""
        self.role = role
        self.host = host
        self.config_file = config_file
        # Each worker binds free ports itself (HTTP, KV, events) and reports the HTTP one through
        # a file: ports picked here could be taken by someone else before a worker binds them.
        self.port_file = log_dir / f"{role}-{index}.port"
        self.port: int | None = None
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "worker",
            "--role",
            role,
            "--config",
            str(config_file),
            "--host",
            host,
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if k not in ROUTER_SECRETS}
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[k] = str(threads)
        env.pop(core_share.ENV, None)
        if share_cores and not cpu_affinity:
            env[core_share.ENV] = str(log_dir / "cores")
        self.log_path = log_dir / f"{role}-{index}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=_preexec(cpu_affinity)
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def bound_port(self) -> int | None:
        """The HTTP port, once the worker has written it (it picks a free one when given none)."""
        if self.port is None and self.port_file.exists():
            self.port = int(self.port_file.read_text())
        return self.port

    def healthy(self) -> bool:
        if self.bound_port() is None:
            return False
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
