"""The router's hands on one machine: start and stop local worker processes (`pdserve serve`).

A worker the controller adds registers itself with the router (`--router-url`) and is routed to once
healthy; one a rollout starts (control/rollout_api.py) runs the config it was given and is added by
the router once it answers. One it stops has been emptied first (control/role_switch.py
empty_worker), so its SIGTERM finds nothing left to finish. It keeps the config file of every
version it ran, so that a rollback can start the old version again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pdserve.config import Config, for_role, load_config, shares_idle_cores
from pdserve.control.rollout_keys import rollout_worker_config
from pdserve.version import config_digest
from pdserve.worker_process import WorkerProcess, write_worker_config

if TYPE_CHECKING:  # the router hands these in; at run time the control plane imports no router module
    from pdserve.router.registry import Worker

log = logging.getLogger(__name__)


class LocalFleet:
    def __init__(
        self, config: Config, workers: list[WorkerProcess], config_file: Path, log_dir: Path, router_url: str
    ) -> None:
        """`workers`: the deployment's processes; the fleet adds to and removes from this list, so
        whoever stops the deployment stops the ones it started too."""
        self.config, self.workers = config, workers
        self.config_file, self.log_dir, self.router_url = config_file, log_dir, router_url
        self.shares_cores = shares_idle_cores(config)  # as the workers it starts do
        self._index = itertools.count(100)
        self._added: list[WorkerProcess] = []  # started here, not yet registered
        self.versions: dict[str, Path] = {}  # version label -> the config file its workers read

    async def add(self, role: str, like: Worker | None = None) -> str:
        """A worker of `role` reading the config file `like` reads (its version; after a rollout,
        the new config), else the deployment's."""
        config_file, config = self.config_file, self.config
        if like is not None and like.version:
            await self.remember(like)
            if like.version in self.versions:
                config_file = self.versions[like.version]
                config = load_config(config_file)
        # A prefill or decode role's config always has its threads (config.apply_role: ROLE_THREADS).
        proc = WorkerProcess(
            role,
            next(self._index),
            config_file,
            "127.0.0.1",
            for_role(config, role).server.threads,  # type: ignore[arg-type]
            getattr(config.deployment, role).cpu_affinity,
            self.log_dir,
            ["--router-url", self.router_url],
            shares_idle_cores(config),
        )
        self.workers.append(proc)
        self._added.append(proc)
        log.info("started a %s worker (pid %d, log %s)", role, proc.proc.pid, proc.log_path)
        return f"{role} pid {proc.proc.pid}"

    def starting(self, registered: set[str]) -> int:
        n = 0
        for p in list(self._added):
            if p.proc.poll() is not None:
                log.warning(
                    "the %s worker started by the controller exited with %d; log: %s",
                    p.role,
                    p.proc.returncode,
                    p.log_path,
                )
                self._added.remove(p)
                continue
            if p.bound_port() is None or p.url not in registered:
                n += 1
            else:
                self._added.remove(p)  # registered: counted with its pool from now on
        return n

    def write_config(self, data: dict) -> tuple[Path, Config]:
        """Check `data` as a config file (ConfigError names each bad key, and each key that is the
        deployment's to set: control/rollout_keys.py) and write it as this deployment's workers read it."""
        raw = self.log_dir / f"rollout-{next(self._index)}.yaml"
        raw.write_text(yaml.safe_dump(data))
        config = rollout_worker_config(self.config, load_config(raw))
        return write_worker_config(config, self.log_dir / f"deployment-{config_digest(config)}.yaml"), config

    def version_file(self, version: str) -> Path | None:
        return self.versions.get(version)

    async def remember(self, w: Worker) -> None:
        """Keep the config file `w` runs under its version (before it is stopped: for a rollback)."""
        proc = self._process(w)
        if proc is not None and w.version:
            self.versions.setdefault(w.version, proc.config_file)

    async def start(self, role: str, config_file: Path, timeout_s: float, near: str | None = None) -> str:
        """Start a worker of `role` reading `config_file`; its URL once it answers /health. One that
        exits or stays silent past `timeout_s` is stopped, and the RuntimeError carries its log's tail.
        `near` (the URL of the worker it replaces) does not matter on one host."""
        config = load_config(config_file, role=role)
        proc = WorkerProcess(
            role,
            next(self._index),
            config_file,
            "127.0.0.1",
            config.server.threads,  # type: ignore[arg-type]
            getattr(config.deployment, role).cpu_affinity,
            self.log_dir,
            [],
            shares_idle_cores(config),
        )
        self.workers.append(proc)
        log.info(
            "started a %s worker with %s (pid %d, log %s)",
            role,
            config_file.name,
            proc.proc.pid,
            proc.log_path,
        )
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(proc.healthy):
            exited = proc.proc.poll()
            if exited is not None or time.monotonic() > deadline:
                proc.stop()
                await asyncio.to_thread(proc.wait, 10.0)
                self.workers.remove(proc)
                why = (
                    f"exited with {exited}" if exited is not None else f"was not healthy after {timeout_s:g}s"
                )
                raise RuntimeError(
                    f"the new {role} worker {why}; log {proc.log_path}:\n"
                    + proc.log_path.read_text(errors="replace")[-1500:]
                )
            await asyncio.sleep(0.2)
        return proc.url

    def _process(self, w: Worker) -> WorkerProcess | None:
        return next((p for p in self.workers if p.bound_port() is not None and p.url == w.url), None)

    async def remove(self, w: Worker) -> None:
        proc = self._process(w)
        if proc is None:
            raise RuntimeError(f"worker {w.worker_id!r} ({w.url}) was not started by this deployment")
        proc.stop()
        await asyncio.to_thread(proc.wait, self.config.server.shutdown_timeout_s)
        self.workers.remove(proc)
        log.info("stopped worker %s (pid %d)", w.worker_id, proc.proc.pid)
