"""The router's view of its workers: registration, heartbeats, health checks, circuit breakers, draining.

Workers come from the config (static) or register themselves (`POST /admin/workers/register`) and
send heartbeats. A worker is unhealthy after failed health checks, or when a self-registered one
misses heartbeats. Each worker has a circuit breaker: closed, open after N consecutive failures,
half-open after a cooldown (one probe request), closed again on a success.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

import httpx

from pdserve.protocol import WorkerRegistration
from pdserve.protocol.health import WorkerHealth
from pdserve.version import version_label

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class Breaker:
    failures_to_open: int
    cooldown_s: float
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False

    def allows(self, now: float) -> bool:
        """Whether a request may go to this worker now (a half-open breaker lets one probe through)."""
        if self.state == BreakerState.OPEN and now - self.opened_at >= self.cooldown_s:
            self.state, self.probing = BreakerState.HALF_OPEN, False
        if self.state == BreakerState.HALF_OPEN:
            return not self.probing
        return self.state == BreakerState.CLOSED

    def on_attempt(self) -> None:
        if self.state == BreakerState.HALF_OPEN:
            self.probing = True

    def on_success(self) -> None:
        self.state, self.failures, self.probing = BreakerState.CLOSED, 0, False

    def on_abandon(self) -> None:
        """The attempt ended with no verdict on this worker (the client left, or the work went
        elsewhere): a half-open breaker lets the next probe through instead of waiting forever."""
        if self.state == BreakerState.HALF_OPEN:
            self.probing = False

    def on_failure(self, now: float) -> None:
        self.failures += 1
        if self.state == BreakerState.HALF_OPEN or self.failures >= self.failures_to_open:
            if self.state != BreakerState.OPEN:
                log.warning("circuit breaker opens after %d failures", self.failures)
            self.state, self.opened_at, self.probing = BreakerState.OPEN, now, False


@dataclass
class Worker:
    worker_id: str
    role: str
    url: str
    breaker: Breaker
    model: str | None = None
    pid: int | None = None
    kv_endpoint: str | None = None
    kv_events_endpoint: str | None = None
    capacity: int = 64
    static: bool = True
    healthy: bool = False
    draining: bool = False
    last_heartbeat: float = 0.0
    health: WorkerHealth | None = None  # the worker's last /health body
    pdserve_version: str | None = None  # its version label's parts (pdserve/version.py)
    config_digest: str | None = None
    # The router's own accounting of what it sent there.
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    decode_tokens: int = 0
    requests: int = 0
    errors: int = 0
    retries: int = 0
    migrations: int = 0

    @property
    def version(self) -> str | None:
        return version_label(self.config_digest, self.pdserve_version)

    def describe(self) -> dict:
        h = self.health
        return {
            "id": self.worker_id,
            "role": self.role,
            "url": self.url,
            "pid": self.pid,
            "model": self.model,
            "version": self.version,
            "pdserve_version": self.pdserve_version,
            "config_digest": self.config_digest,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker": self.breaker.state.value,
            "load": {
                "in_flight": self.in_flight,
                "queued_prefill_tokens": self.queued_prefill_tokens,
                "decode_tokens": self.decode_tokens,
                "kv_usage": h.kv_usage if h else None,
                "running": h.running if h else None,
                "waiting": h.waiting if h else None,
            },
            "kv_endpoint": self.kv_endpoint,
            "requests": self.requests,
            "errors": self.errors,
            "retries": self.retries,
            "migrations": self.migrations,
        }


class Registry:
    def __init__(
        self,
        breaker_failures: int,
        breaker_cooldown_s: float,
        heartbeat_timeout_s: float,
        internal_headers: dict[str, str],
    ) -> None:
        self.workers: dict[str, Worker] = {}
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.headers = internal_headers
        self._ids = 0

    def _breaker(self) -> Breaker:
        return Breaker(self.breaker_failures, self.breaker_cooldown_s)

    def add_static(self, url: str, role: str) -> Worker:
        self._ids += 1
        w = Worker(f"{role}-{self._ids}", role, url.rstrip("/"), self._breaker())
        self.workers[w.worker_id] = w
        return w

    def register(self, reg: WorkerRegistration, now: float) -> Worker:
        w = self.workers.get(reg.worker_id)
        if w is None:
            w = Worker(reg.worker_id, reg.role, reg.url.rstrip("/"), self._breaker(), static=False)
            self.workers[w.worker_id] = w
            log.info("worker %s (%s) registered at %s", w.worker_id, w.role, w.url)
        w.model, w.pid, w.kv_endpoint, w.capacity = reg.model, reg.pid, reg.kv_endpoint, reg.capacity
        w.pdserve_version, w.config_digest = reg.pdserve_version, reg.config_digest
        w.role = reg.role  # a worker re-registers after switching role (server/role_switch.py)
        w.last_heartbeat = now
        return w

    def heartbeat(self, worker_id: str, now: float) -> bool:
        w = self.workers.get(worker_id)
        if w is None:
            return False
        w.last_heartbeat = now
        return True

    def deregister(self, worker_id: str) -> bool:
        return self.workers.pop(worker_id, None) is not None

    def pool(self, role: str) -> list[Worker]:
        """Workers that can take `role` work (a mixed worker can do both)."""
        return [w for w in self.workers.values() if w.role == role or w.role == "mixed"]

    async def check(self, client: httpx.AsyncClient, w: Worker, now: float) -> None:
        try:
            r = await client.get(w.url + "/health", timeout=2.0, headers=self.headers)
            ok = r.status_code == 200
            if ok:
                w.health = h = WorkerHealth.from_wire(r.json())
                w.pid = h.pid if h.pid is not None else w.pid
                w.model = h.model if h.model is not None else w.model
                w.kv_endpoint = h.kv_endpoint or w.kv_endpoint
                w.kv_events_endpoint = h.kv_events_endpoint or w.kv_events_endpoint
                w.capacity = h.max_num_seqs if h.max_num_seqs is not None else w.capacity
                w.pdserve_version = h.pdserve_version or w.pdserve_version
                w.config_digest = h.config_digest or w.config_digest
        except (httpx.HTTPError, ValueError):
            ok = False
        if not w.static and now - w.last_heartbeat > self.heartbeat_timeout_s:
            ok = False
        if ok != w.healthy:
            log.log(
                logging.INFO if ok else logging.WARNING,
                "worker %s (%s) is %s",
                w.worker_id,
                w.url,
                "healthy" if ok else "unhealthy",
            )
            if ok and w.breaker.state != BreakerState.CLOSED:
                # Back after a partition, a stop or a restart: the failures that opened the breaker are
                # explained. Half-open would let one request through at a time, and every stream that
                # needs to migrate onto this worker meanwhile would find no decode worker at all.
                log.info("worker %s: circuit breaker closed on recovery", w.worker_id)
                w.breaker.on_success()
        w.healthy = ok

    async def check_all(self, client: httpx.AsyncClient) -> None:
        now = time.monotonic()
        await asyncio.gather(*(self.check(client, w, now) for w in list(self.workers.values())))
