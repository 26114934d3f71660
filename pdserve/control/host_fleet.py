"""The router's hands on a deployment that spans hosts without Kubernetes (controller.backend: hosts).

Each worker host runs `pdserve agent` (control/host_agent.py); `controller.agents` lists their URLs.
The fleet asks them to start and stop workers, with the internal token:
- add (the controller's scale-up): on the host with the fewest live workers, running the version
  most of the fleet runs (after a rollout, its new config); the worker registers with the routers
  the agent names.
- start (a rollout's new worker): on the host of the worker it replaces when one is named (a
  replacement keeps the host's share of the work), else on the least loaded; returned once healthy.
- remove: the agent that started the worker (found by its URL) stops it.
A start carries an idempotency key and is sent again while no reply comes; one never confirmed has
its worker stopped once its agent lists it.
A rollback starts a version this fleet ran before: the config of a worker it retires is kept under
that worker's version, read back from the worker's agent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import yaml

from pdserve.config import Config, load_config
from pdserve.control.rollout_keys import rollout_worker_config
from pdserve.protocol import INTERNAL_TOKEN_HEADER
from pdserve.protocol.control import HostStart, HostWorker
from pdserve.version import config_digest

if TYPE_CHECKING:  # the router hands these in; at run time the control plane imports no router module
    from pdserve.router.registry import Worker

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # a worker added that has not registered by then is no longer counted as starting
POLL_S = 0.5
START_ATTEMPTS, START_RETRY_S = 4, 0.5  # a start whose reply was lost, sent again (0.5, 1, 1.5 s apart)
CALL_TIMEOUT_S = 30.0  # one call to an agent (a stop waits for the worker's drain: see stop_timeout)


@dataclass
class Pending:
    agent: str
    id: str
    until: float
    url: str | None = None
    exited: bool = False


class AgentUnreachable(RuntimeError):
    """A call that got no answer (refused, timed out, cut): the agent may have carried it out."""


class HostsFleet:
    workers_register = True  # the agents' workers register with the routers (pdserve agent --router-url)
    shares_cores = False  # workers on several hosts

    def __init__(self, config: Config, agents: list[str], token: str | None, work_dir: Path) -> None:
        self.config, self.agents = config, [a.rstrip("/") for a in agents]
        self.headers = {INTERNAL_TOKEN_HEADER: token} if token else {}
        self.work_dir = work_dir
        self._index = itertools.count(1)
        self._pending: list[Pending] = []
        self._tasks: set[asyncio.Task] = set()
        self.versions: dict[str, Path] = {}  # version label -> the config file its workers read
        self._client: httpx.AsyncClient | None = None  # one pool for every call (a start polls)
        # Starts no reply confirmed (agent -> their keys): the worker one made is stopped once its
        # agent lists it, so a lost reply leaves no worker nobody knows of.
        self._abandoned: dict[str, set[str]] = {}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ agents

    async def _call(self, method: str, agent: str, path: str, timeout: float = CALL_TIMEOUT_S, **kw):
        if self._client is None:  # made on first use: inside the router's event loop
            self._client = httpx.AsyncClient(headers=self.headers)
        try:
            r = await self._client.request(method, agent + path, timeout=timeout, **kw)
        except httpx.HTTPError as e:  # a failed call, as a refused one: the caller's 502, never a 500
            raise AgentUnreachable(f"agent {agent} {method} {path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            raise RuntimeError(f"agent {agent} {method} {path}: {r.status_code} {r.text[:300]}")
        return r.json()

    async def _listing(self) -> dict[str, list[HostWorker]]:
        """Every reachable agent's workers; an unreachable agent lists none (and is logged)."""

        async def one(agent: str) -> list[HostWorker]:
            try:
                got = await self._call("GET", agent, "/agent/workers", timeout=10.0)
            except (httpx.HTTPError, RuntimeError) as e:
                log.warning("host agent %s: %s", agent, e)
                return []
            return [HostWorker(**w) for w in got["workers"]]

        lists = await asyncio.gather(*(one(a) for a in self.agents))
        listing = dict(zip(self.agents, lists))
        for agent, ws in listing.items():
            keys = self._abandoned.get(agent)
            for w in ws:
                if keys and w.request_id in keys and w.alive:
                    keys.discard(w.request_id)
                    self._spawn(self._stop_abandoned(agent, w))
        return listing

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_abandoned(self, agent: str, w: HostWorker) -> None:
        log.warning("stopping worker %s on %s: its start was never confirmed", w.id, agent)
        try:
            await self._call("DELETE", agent, f"/agent/workers/{w.id}", timeout=CALL_TIMEOUT_S * 2)
        except RuntimeError as e:
            log.warning("could not stop worker %s on %s: %s", w.id, agent, e)

    async def _start_on(self, agent: str, role: str, config: dict) -> HostWorker:
        """POST a start, again with the same key while no reply comes (the agent answers a key it has
        seen with the worker that start made, and makes no other). A start still unconfirmed is
        remembered, and its worker stopped once the agent lists it."""
        key = uuid.uuid4().hex
        body = HostStart(role=role, config=config, request_id=key).model_dump()  # type: ignore[arg-type]
        for attempt in range(1, START_ATTEMPTS):
            try:
                return HostWorker(**await self._call("POST", agent, "/agent/workers", json=body))
            except AgentUnreachable:
                await asyncio.sleep(START_RETRY_S * attempt)
        try:
            return HostWorker(**await self._call("POST", agent, "/agent/workers", json=body))
        except AgentUnreachable:
            self._abandoned.setdefault(agent, set()).add(key)
            raise

    async def _pick(self, near: str | None = None) -> str:
        if near is not None:
            host = urlsplit(near).hostname
            same = [a for a in self.agents if urlsplit(a).hostname == host]
            if same:
                return same[0]
        listing = await self._listing()
        return min(self.agents, key=lambda a: (sum(w.alive for w in listing[a]), self.agents.index(a)))

    def _config(self) -> dict:
        # Workers take the internal token, never the routers' client or admin keys.
        d = self.config.to_dict()
        d["router"] = {**d["router"], "api_keys": [], "admin_keys": []}
        return d

    # ------------------------------------------------------------------ the controller's Fleet

    async def add(self, role: str, like: Worker | None = None) -> str:
        """A worker of `role` running `like`'s config (its version, read back from its agent)."""
        config = self._config()
        if like is not None and like.version:
            await self.remember(like)
            if like.version in self.versions:
                config = yaml.safe_load(self.versions[like.version].read_text())
        agent = await self._pick()
        w = await self._start_on(agent, role, config)
        p = Pending(agent, w.id, time.monotonic() + START_TIMEOUT_S)
        self._pending.append(p)
        self._spawn(self._follow(p))
        return f"{role} {w.id} on {agent}"

    async def _follow(self, p: Pending) -> None:
        """Learn an added worker's URL, and that it exited, for `starting`: until it registered
        (`starting` dropped it), exited or ran out of time. A worker that dies after it bound its
        port, before registering, would otherwise count as starting until the deadline, and the
        controller would hold that long."""
        while time.monotonic() < p.until and not p.exited and p in self._pending:
            await asyncio.sleep(POLL_S)
            for w in (await self._listing()).get(p.agent, []):
                if w.id == p.id:
                    p.url, p.exited = w.url, not w.alive
                    if p.exited:
                        log.warning(
                            "worker %s on %s exited with %s:\n%s", w.id, p.agent, w.exit_code, w.log_tail
                        )

    def starting(self, registered: set[str]) -> int:
        now = time.monotonic()
        self._pending = [
            p for p in self._pending if now < p.until and not p.exited and p.url not in registered
        ]
        return len(self._pending)

    async def _find(self, w: Worker, alive: bool = True) -> tuple[str, HostWorker] | None:
        """The agent's process of `w`: the same URL and, when `w` registered its pid, the same pid (a
        process restarted on the same port is another worker, not the one to stop). With
        alive=False an exited one is found too."""
        for agent, ws in (await self._listing()).items():
            for hw in ws:
                if (hw.alive or not alive) and hw.url is not None and hw.url.rstrip("/") == w.url.rstrip("/"):
                    if w.pid is None or w.pid == hw.pid:
                        return agent, hw
        return None

    async def remove(self, w: Worker) -> None:
        # One that died is removed from its agent's list too: no one restarts a retired worker.
        found = await self._find(w) or await self._find(w, alive=False)
        if found is None:
            raise RuntimeError(f"worker {w.worker_id!r} ({w.url}) was not started by this fleet's agents")
        agent, hw = found
        # The agent waits for the worker's drain (its shutdown timeout), then kills it.
        timeout = self.config.server.shutdown_timeout_s + CALL_TIMEOUT_S
        await self._call("DELETE", agent, f"/agent/workers/{hw.id}", timeout=timeout)
        log.info("stopped worker %s (%s on %s)", w.worker_id, hw.id, agent)

    # ------------------------------------------------------------------ a rollout's RolloutFleet

    def write_config(self, data: dict) -> tuple[Path, Config]:
        """Check `data` as a config file (ConfigError names each bad key) and keep it for starts."""
        n = next(self._index)
        raw = self.work_dir / f"rollout-{n}.yaml"
        raw.write_text(yaml.safe_dump(data))
        config = rollout_worker_config(self.config, load_config(raw))
        path = self.work_dir / f"deployment-{config_digest(config)}.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()))
        return path, config

    def version_file(self, version: str) -> Path | None:
        return self.versions.get(version)

    async def remember(self, w: Worker) -> None:
        """Keep the config `w` runs under its version (before it is stopped: for a rollback)."""
        if not w.version or w.version in self.versions:
            return
        found = await self._find(w)
        if found is None:
            return
        agent, hw = found
        got = await self._call("GET", agent, f"/agent/workers/{hw.id}/config")
        path = self.work_dir / f"version-{w.version}.yaml"
        path.write_text(yaml.safe_dump(got["config"]))
        self.versions[w.version] = path

    async def start(self, role: str, config_file: Path, timeout_s: float, near: str | None = None) -> str:
        """Start a worker of `role` reading `config_file`; its URL once it answers /health. One that
        exits or stays silent past `timeout_s` is stopped, and the RuntimeError carries its log's tail."""
        agent = await self._pick(near)
        data = yaml.safe_load(config_file.read_text())
        w = await self._start_on(agent, role, data)
        log.info("started a %s worker %s on %s with %s", role, w.id, agent, config_file.name)
        deadline = time.monotonic() + timeout_s
        while True:
            now = {x.id: x for x in (await self._listing()).get(agent, [])}
            cur = now.get(w.id)
            if cur is not None and cur.healthy and cur.url:
                return cur.url
            # An agent that does not answer one listing is not yet a failed start: the deadline decides.
            if (cur is not None and not cur.alive) or time.monotonic() > deadline:
                why = (
                    f"exited with {cur.exit_code}"
                    if cur is not None and not cur.alive
                    else f"was not healthy after {timeout_s:g}s"
                )
                if cur is not None and cur.alive:
                    await self._call("DELETE", agent, f"/agent/workers/{w.id}", timeout=CALL_TIMEOUT_S * 2)
                raise RuntimeError(
                    f"the new {role} worker on {agent} {why}" + (f":\n{cur.log_tail}" if cur else "")
                )
            await asyncio.sleep(POLL_S)


def hosts_fleet(config: Config) -> HostsFleet:
    """The fleet of `controller.agents`, calling them with the internal token."""
    import tempfile

    from pdserve.server.internal_api import internal_token

    work = Path(tempfile.mkdtemp(prefix="pdserve-fleet-"))
    return HostsFleet(config, config.controller.agents, internal_token(config.server.internal_token), work)
