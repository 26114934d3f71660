"""The controller's hands on one machine: start and stop local worker processes (`pdserve serve`).

A worker it starts registers itself with the router (`--router-url`) and is routed to once healthy;
one it stops has been emptied by the controller first (router/role_switch.py empty_worker), so its
SIGTERM finds nothing left to finish.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

from pdserve.config import Config, for_role
from pdserve.worker_process import WorkerProcess
from pdserve.router.registry import Worker

log = logging.getLogger(__name__)


class LocalFleet:
    def __init__(self, config: Config, workers: list[WorkerProcess], config_file: Path, log_dir: Path,
                 router_url: str) -> None:
        """`workers`: the deployment's processes; the fleet adds to and removes from this list, so
        whoever stops the deployment stops the ones it started too."""
        self.config, self.workers = config, workers
        self.config_file, self.log_dir, self.router_url = config_file, log_dir, router_url
        self._index = itertools.count(100)
        self._added: list[WorkerProcess] = []       # started here, not yet registered

    async def add(self, role: str) -> str:
        rc = getattr(self.config.deployment, role)
        proc = WorkerProcess(role, next(self._index), self.config_file, "127.0.0.1",
                             for_role(self.config, role).server.threads, rc.cpu_affinity, self.log_dir,
                             ["--router-url", self.router_url])
        self.workers.append(proc)
        self._added.append(proc)
        log.info("started a %s worker (pid %d, log %s)", role, proc.proc.pid, proc.log_path)
        return f"{role} pid {proc.proc.pid}"

    def starting(self, registered: set[str]) -> int:
        n = 0
        for p in list(self._added):
            if p.proc.poll() is not None:
                log.warning("the %s worker started by the controller exited with %d; log: %s", p.role,
                            p.proc.returncode, p.log_path)
                self._added.remove(p)
                continue
            if p.port is None and p.port_file.exists():
                p.port = int(p.port_file.read_text())
            if p.port is None or p.url not in registered:
                n += 1
            else:
                self._added.remove(p)       # registered: counted with its pool from now on
        return n

    async def remove(self, w: Worker) -> None:
        for p in self.workers:
            if p.port is None and p.port_file.exists():
                p.port = int(p.port_file.read_text())
        proc = next((p for p in self.workers if p.port is not None and p.url == w.url), None)
        if proc is None:
            raise RuntimeError(f"worker {w.worker_id!r} ({w.url}) was not started by this deployment")
        proc.stop()
        await asyncio.to_thread(proc.wait, self.config.server.shutdown_timeout_s)
        self.workers.remove(proc)
        log.info("stopped worker %s (pid %d)", w.worker_id, proc.proc.pid)
