"""`pdserve agent`: a router's hands on one host of a deployment that spans hosts without Kubernetes.

One agent runs on each worker host. It starts `pdserve worker` processes there when the router's
fleet asks (control/host_fleet.py: the controller's scale-ups, a rollout's new workers), stops the
ones it is told to, and restarts one that died (as a supervisor would). Every route but /health
takes the internal token: whoever holds it may start processes on the host, so an agent refuses to
run without one. The workers it starts bind the host's address, publish their KV events there, and
register with the routers the agent was given; they die with the agent.

Routes (bodies in protocol/control.py):
- `POST /agent/workers` (HostStart): start a worker; 201 with its HostWorker.
- `GET /agent/workers`: every worker it started (exited ones too, with their exit code and log tail).
- `GET /agent/workers/{id}/config`: the config the worker was started with (a rollback runs it again).
- `POST /agent/workers/{id}/restart`: start an exited worker again, same role, config and HTTP port
  (the one it had, picked or given), so it returns at its URL.
- `DELETE /agent/workers/{id}`: SIGTERM (the worker drains), SIGKILL after its shutdown timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from pdserve.config import Config, ConfigError, derive, load_config
from pdserve.protocol.control import HostStart, HostWorker
from pdserve.worker_process import WorkerProcess

log = logging.getLogger(__name__)
KEEP_EXITED = 32  # exited workers listed (for their exit code, log tail and a restart), oldest dropped first
STOP_GRACE_S = 5.0  # beyond the worker's own shutdown_timeout_s before SIGKILL
THREADS = 4  # blocking calls at once (a drain waits on one for seconds)


@dataclass
class Started:
    id: str
    req: HostStart
    config_file: Path
    proc: WorkerProcess
    shutdown_s: float
    disk: Path | None = None  # its disk tier's directory when the agent chose it


class HostAgent:
    def __init__(
        self, host: str, router_urls: list[str], threads: int, log_dir: Path, disk_dir: Path | None = None
    ) -> None:
        self.host, self.router_urls, self.threads, self.log_dir = host, router_urls, threads, log_dir
        self.disk_dir = disk_dir  # each worker's disk tier in its own directory below it
        self.workers: dict[str, Started] = {}
        self._index = itertools.count(1)
        self._starting = threading.Lock()  # a start and its retry (same key) run one after the other
        self.http = httpx.Client(timeout=2.0)  # one pool for every health check, not one per call

    def worker_config(self, req: HostStart, n: int, disk: Path | None) -> tuple[Path, Config]:
        """The config file a worker reads: the given config bound to this host (ConfigError names a
        bad key). The routers' client and admin keys are left out: a worker takes the internal token."""
        raw = self.log_dir / f"{req.role}-{n}.given.yaml"
        raw.write_text(yaml.safe_dump(req.config))
        events = f"tcp://{self.host}:{req.kv_events_port or '*'}"
        bound: dict[str, object] = {
            "deployment.mode": "pd",
            "server.host": self.host,
            "server.advertise_host": None,
            "cache.kv_events_endpoint": events,
            "router.api_keys": [],
            "router.admin_keys": [],
        }
        if disk is not None:
            disk.mkdir(parents=True, exist_ok=True)
            bound["cache.disk_cache_dir"] = str(disk)
        config = derive(load_config(raw), bound)
        path = self.log_dir / f"{req.role}-{n}.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()))
        return path, config

    def start(self, req: HostStart, disk: Path | None = None) -> Started:
        """`disk`: a restarted worker's own disk tier directory (its blocks survive the restart). A
        start with a key seen before returns the worker that start made (its caller lost the reply)."""
        with self._starting:
            if req.request_id is not None:
                seen = next((w for w in self.workers.values() if w.req.request_id == req.request_id), None)
                if seen is not None:
                    log.info("start %s again: %s already runs it", req.request_id, seen.id)
                    return seen
            return self._start(req, disk)

    def _start(self, req: HostStart, disk: Path | None) -> Started:
        n = next(self._index)
        if disk is None and self.disk_dir is not None:  # two workers must not share one tier's files
            disk = self.disk_dir / f"{req.role}-{n}"
        path, config = self.worker_config(req, n, disk)
        # Threads through the environment (WorkerProcess), not --threads: a flag would enter the
        # worker's version label, and a rollout compares that label with its config's.
        extra: list[str] = []
        if self.router_urls:
            extra += ["--router-url", ",".join(self.router_urls)]
        if req.port:  # after --port 0 in WorkerProcess's command line: the last one wins
            extra += ["--port", str(req.port)]
        if req.kv_port:
            extra += ["--kv-port", str(req.kv_port)]
        proc = WorkerProcess(req.role, n, path, self.host, self.threads, None, self.log_dir, extra)
        s = Started(f"{req.role}-{n}", req, path, proc, config.server.shutdown_timeout_s, disk)
        self.workers[s.id] = s
        self._prune()
        log.info("started %s (pid %d, log %s)", s.id, proc.proc.pid, proc.log_path)
        return s

    def _prune(self) -> None:
        exited = [w for w in self.workers.values() if w.proc.proc.poll() is not None]
        for w in exited[: max(0, len(exited) - KEEP_EXITED)]:
            w.proc.wait(0)  # reaped; closes its log
            del self.workers[w.id]

    def describe(self, s: Started, check_health: bool = True) -> HostWorker:
        p = s.proc
        code = p.proc.poll()
        port = p.bound_port()
        healthy = code is None and check_health and port is not None and self._healthy(p.url)
        tail = _tail(p.log_path) if code is not None else ""
        return HostWorker(
            id=s.id,
            role=s.req.role,
            pid=p.proc.pid,
            url=p.url if port is not None else None,
            alive=code is None,
            healthy=healthy,
            exit_code=code,
            log_tail=tail,
            request_id=s.req.request_id,
        )

    def _healthy(self, url: str) -> bool:
        try:
            return self.http.get(url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, s: Started) -> None:
        s.proc.stop()
        s.proc.wait(s.shutdown_s + STOP_GRACE_S)  # SIGKILL past it
        self.workers.pop(s.id, None)
        if s.disk is not None:  # no other worker reads it
            shutil.rmtree(s.disk, ignore_errors=True)
        log.info("stopped %s (exit %s)", s.id, s.proc.proc.returncode)


def _tail(path: Path, n: int = 1500) -> str:
    """The last `n` bytes of a log (read from there: a worker's log may be large)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def create_agent_app(agent: HostAgent, token: str):
    from fastapi import FastAPI

    from pdserve.server.errors import error_response
    from pdserve.server.internal_api import RequireInternalToken

    @asynccontextmanager
    async def lifespan(_app):
        # Blocking work (a start, a drain, health checks) runs on these threads, all started now:
        # the agent's footprint after start-up is its footprint.
        pool = ThreadPoolExecutor(THREADS, thread_name_prefix="agent")
        await asyncio.gather(
            *(asyncio.get_running_loop().run_in_executor(pool, time.sleep, 0.05) for _ in range(THREADS))
        )
        asyncio.get_running_loop().set_default_executor(pool)
        yield

    app = FastAPI(title="pdserve host agent", lifespan=lifespan)

    def found(worker_id: str) -> Started | None:
        return agent.workers.get(worker_id)

    def unknown(worker_id: str):
        return error_response(404, f"no worker {worker_id!r} on this host", code="unknown_worker")

    @app.get("/health")
    async def health():
        alive = sum(w.proc.proc.poll() is None for w in agent.workers.values())
        return {"status": "ok", "host": agent.host, "workers": alive}

    @app.get("/agent/workers")
    async def list_workers():
        ws = list(agent.workers.values())
        described = await asyncio.gather(*(asyncio.to_thread(agent.describe, w) for w in ws))
        return {"host": agent.host, "workers": [d.model_dump() for d in described]}

    @app.post("/agent/workers", status_code=201)
    async def start(body: HostStart):
        try:
            s = await asyncio.to_thread(agent.start, body)
        except ConfigError as e:
            return error_response(
                400, "; ".join(f"{k}: {p}" for k, p in e.problems), "config", "invalid_value"
            )
        return (await asyncio.to_thread(agent.describe, s, False)).model_dump()

    @app.get("/agent/workers/{worker_id}/config")
    async def worker_config(worker_id: str):
        s = found(worker_id)
        return unknown(worker_id) if s is None else {"role": s.req.role, "config": s.req.config}

    @app.post("/agent/workers/{worker_id}/restart", status_code=201)
    async def restart(worker_id: str):
        s = found(worker_id)
        if s is None:
            return unknown(worker_id)
        if s.proc.proc.poll() is None:
            return error_response(409, f"{worker_id} is running; stop it first", code="worker_running")
        await asyncio.to_thread(s.proc.wait, 0)  # exited: closes its log file
        agent.workers.pop(worker_id, None)
        # Back at the URL it had (its HTTP port, even one it was left to pick): the routers know a
        # worker by its URL, so the restart is the same worker again, not a new one beside a dead entry.
        port = s.proc.bound_port()
        req = s.req if s.req.port or port is None else s.req.model_copy(update={"port": port})
        new = await asyncio.to_thread(agent.start, req, s.disk)
        return (await asyncio.to_thread(agent.describe, new, False)).model_dump()

    @app.delete("/agent/workers/{worker_id}")
    async def stop(worker_id: str):
        s = found(worker_id)
        if s is None:
            return unknown(worker_id)
        await asyncio.to_thread(agent.stop, s)
        return (await asyncio.to_thread(agent.describe, s, False)).model_dump()

    return RequireInternalToken(app, token)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve agent", description="start and stop this host's workers for a router's fleet"
    )
    p.add_argument("--config", help="config file: the internal token (server.internal_token) and defaults")
    p.add_argument("--host", required=True, help="this host's address: the agent and its workers bind it")
    p.add_argument("--port", type=int, default=7070, help="the agent's port (default 7070)")
    p.add_argument("--router-url", default="", help="comma-separated routers its workers register with")
    p.add_argument("--threads", type=int, help="threads per worker (default: server.threads, else 1)")
    p.add_argument("--log-dir", help="worker configs and logs (default: a new temporary directory)")
    p.add_argument(
        "--disk-cache-dir",
        help="this host's disk for the KV disk tier: each worker gets its own directory below it "
        "(default: the config's cache.disk_cache_dir, shared)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.server.internal_api import internal_token

    try:
        config = load_config(args.config)
    except ConfigError as e:
        for key, problem in e.problems:
            print(f"pdserve agent: config error: {key}: {problem}", file=sys.stderr)
        return 2
    token = internal_token(config.server.internal_token)
    if not token:
        print(
            "pdserve agent: config error: server.internal_token: an agent starts processes for whoever "
            "calls it, so it needs the internal token (server.internal_token or PDSERVE_INTERNAL_TOKEN)",
            file=sys.stderr,
        )
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-agent-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = args.threads or config.server.threads or 1
    routers = [u for u in args.router_url.split(",") if u]
    disk = Path(args.disk_cache_dir) if args.disk_cache_dir else None
    agent = HostAgent(args.host, routers, threads, log_dir, disk)
    from pdserve.server.serving import bind_socket, run_uvicorn

    sock = bind_socket(args.host, args.port)
    config = derive(config, {"server.host": args.host, "server.port": sock.getsockname()[1]})
    log.info("host agent on http://%s:%d; worker logs in %s", args.host, config.server.port, log_dir)
    try:
        run_uvicorn(create_agent_app(agent, token), config, sock=sock)
    finally:
        for s in list(agent.workers.values()):
            if s.proc.proc.poll() is None:
                agent.stop(s)
    return 0
