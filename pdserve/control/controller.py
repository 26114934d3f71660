"""The autoscaler (controller: config, off by default), a task in the router process.

Every `controller.interval_s` it reads the fleet (TTFT p90 and the mean inter-token gap over the
interval from the router's own histograms, decode KV usage, running and waiting requests from the workers'
health, queued prefill tokens from the router's accounting, the longest wait for a first token, the
backlog ahead of a new prompt at the prefill pool's measured rate, the gap forecast for a new
decode stream from the streams a decode worker holds and how fast they grow),
asks the pure policy (control/scaling_policy.py) what to do, and does it: a role switch through the
router (drain, switch in place: control/role_switch.py; after a switch to decode the streams piled
on the other decode workers move over to even the pool out), or a worker added or removed through a
`Fleet` (local processes: pdserve/control/local_fleet.py; Kubernetes Deployments: control/k8s_fleet.py). A removal empties
the worker first, so no request is lost. Every decision, holds included, is kept with its inputs
and reason for `GET /admin/controller`; actions are counted in /metrics. With controller.enabled
false it only reads and exports each pool's pressure, for an HPA (deploy/k8s/hpa.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.config import Config
from pdserve.control.leader import LeaderLease
from pdserve.control.role_switch import SwitchRefused, back_into_service, empty_worker, even_out, switch_role
from pdserve.control.scaling_policy import (
    Decision,
    Params,
    Reading,
    State,
    decide,
    fleet_version,
    pressures,
)
from pdserve.protocol.control import ControllerDecision

if TYPE_CHECKING:  # the router hands these in; at run time the control plane imports no router module
    from pdserve.router.registry import Registry, Worker

log = logging.getLogger(__name__)


class Fleet(Protocol):
    """Starts and stops workers of a pool (the controller switches roles itself)."""

    # Its workers share one host's cores, an idle one lending its threads to the others' decode
    # steps (deployment.share_idle_cores, utils/core_share.py).
    shares_cores: bool

    async def add(self, role: str, like: Worker | None = None) -> str:
        """Start one worker of `role` running the config `like` runs (its version; None: the
        deployment's config); returns what was started (it registers with the router itself)."""
        ...

    async def remove(self, w: Worker) -> None:
        """Stop the worker `w` (already emptied by the controller)."""
        ...

    def starting(self, registered: set[str]) -> int:
        """Workers it started that are alive and not yet among the `registered` URLs."""
        ...


class NoFleet:
    """Where nothing can start or stop workers: the controller only switches roles."""

    shares_cores = False

    async def add(self, role: str, like: Worker | None = None) -> str:
        raise RuntimeError(
            "this router cannot start workers (run it with `pdserve serve`, or controller.backend kubernetes)"
        )

    async def remove(self, w: Worker) -> None:
        raise RuntimeError("this router cannot stop workers")

    def starting(self, registered: set[str]) -> int:
        return 0


def buckets(hist: Histogram) -> list[tuple[float, float]]:
    """A histogram's cumulative (upper bound, count) pairs now."""
    return [
        (float(s.labels["le"]), s.value)
        for m in hist.collect()
        for s in m.samples
        if s.name.endswith("_bucket")
    ]


def sum_count(hist: Histogram) -> tuple[float, float]:
    """A histogram's (sum, count) now."""
    got = {
        s.name.rsplit("_", 1)[1]: s.value
        for m in hist.collect()
        for s in m.samples
        if s.name.endswith(("_sum", "_count"))
    }
    return got.get("sum", 0.0), got.get("count", 0.0)


def quantile_between(
    before: list[tuple[float, float]], after: list[tuple[float, float]], q: float
) -> float | None:
    """The q-quantile of what a cumulative histogram observed between two snapshots, interpolated
    within its bucket (as Prometheus' histogram_quantile); None when it observed nothing."""
    prev = dict(before)
    counts = [(le, c - prev.get(le, 0.0)) for le, c in after]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo, below = 0.0, 0.0
    for le, c in counts:
        if c >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((rank - below) / (c - below) if c > below else 1.0)
        lo, below = le, c
    return lo


class PrefillBacklog:
    """The wait ahead of a prompt sent now to the prefill pool: the least-queued prefill worker's
    queued prompt tokens at the pool's measured seconds per token. A TTFT read off first tokens or
    off the longest wait comes after requests have waited; the queue says it as it builds.

    The rate is measured, not profiled: over an interval in which a worker had prompts queued at
    both readings (busy throughout), its interval over the prompt tokens it computed, summed over
    the last `keep` such samples (a ratio of sums: prompts longer than an interval give samples
    of zero tokens, which count as busy time). The queue counts the prompt in progress whole and
    not the newcomer's own: about one prompt either way."""

    def __init__(self, keep: int = 8) -> None:
        self.samples: deque[tuple[float, int]] = deque(maxlen=keep)
        self.last: dict[str, tuple[int, float]] = {}
        self.at: float | None = None

    def update(self, now: float, workers: dict[str, tuple[int, float]]) -> float | None:
        """workers: each prefill worker's (prompt tokens computed so far, prompt tokens queued at it).
        Returns seconds, or None before any busy interval was measured."""
        if self.at is not None:
            for wid, (computed, queued) in workers.items():
                before = self.last.get(wid)
                if before is not None and before[1] > 0 and queued > 0 and computed >= before[0]:
                    self.samples.append((now - self.at, computed - before[0]))
        self.last, self.at = dict(workers), now
        tokens = sum(n for _, n in self.samples)
        if not workers or tokens <= 0:
            return None
        return min(q for _, q in workers.values()) * sum(t for t, _ in self.samples) / tokens


class DecodeForecast:
    """The mean gap a decode stream sent now will see: the pool's step cost at the streams a decode
    worker will hold `horizon_s` ahead if they keep growing as over the last `trend` readings. The
    mean gap read off the streams crosses the SLO only once they have piled up (a generation-heavy
    phase: ~20 s in); the stream count says it as it grows, as PrefillBacklog does for prompts.

    The step cost is measured, not profiled: gap = base + per_stream * streams, a least-squares fit
    over the last `keep` readings with a gap, refused (None: the pool reads as its gap now) until
    they span `spread` streams a worker (one load level says nothing of the slope) or when the fit
    slopes down. Growth is never negative: a pool whose streams fall reads as its fitted gap now."""

    def __init__(self, horizon_s: float, keep: int = 15, trend: int = 3, spread: float = 4.0) -> None:
        self.horizon_s, self.spread = horizon_s, spread
        self.samples: deque[tuple[float, float]] = deque(maxlen=keep)
        self.counts: deque[tuple[float, float]] = deque(maxlen=trend)
        self.base_ms: float | None = None  # the fit's gap at no stream: the step's fixed cost

    def update(self, now: float, streams: float, gap_ms: float | None) -> float | None:
        """streams: running streams per decode worker now; gap_ms: the interval's mean gap (None: no
        gap in it). Returns milliseconds, or None while the step cost is unknown."""
        self.counts.append((now, streams))
        if streams <= 0:
            # An idle pool: a stream sent now sees one stream's gap however many workers the pool
            # has, so it says nothing of the pool's size (the fit kept from a busy phase, noise
            # and faults included, would keep an idle pool from ever reading as cold).
            return None
        if gap_ms is not None:
            self.samples.append((streams, gap_ms))
        ns = [n for n, _ in self.samples]
        if len(ns) < 4 or max(ns) - min(ns) < self.spread:
            self.base_ms = None
            return None
        mean_n, mean_g = sum(ns) / len(ns), sum(g for _, g in self.samples) / len(ns)
        per_stream = sum((n - mean_n) * (g - mean_g) for n, g in self.samples) / sum(
            (n - mean_n) ** 2 for n in ns
        )
        if per_stream <= 0:
            self.base_ms = None
            return None
        self.base_ms = max(0.0, mean_g - per_stream * mean_n)
        (t0, n0) = self.counts[0]
        growth = max(0.0, (streams - n0) / (now - t0)) if now > t0 else 0.0
        return mean_g + per_stream * (streams + growth * self.horizon_s - mean_n)


class Controller:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        client: httpx.AsyncClient,
        ttft: Histogram,
        itl: Histogram,
        fleet: Fleet | None,
        metrics: CollectorRegistry,
        oldest_wait: Callable[[float], float | None] = lambda now: None,
        held_prefill_tokens: Callable[[], int] = lambda: 0,
    ) -> None:
        self.cc = config.controller
        # Off (controller.enabled false): it still reads the fleet and exports the pressure gauges,
        # for an HPA to act on (deploy/k8s/hpa.yaml), but decides and does nothing.
        self.acting = config.controller.enabled
        # Router replicas elect the one that acts (control/leader.py); one router needs no lease.
        url = self.cc.leader_lease or config.router.shared_limits
        self.lease = LeaderLease(url, config.model.name, self.cc.lease_s) if self.acting and url else None
        self.registry, self.client = registry, client
        self.ttft, self.itl = ttft, itl
        self.oldest_wait = oldest_wait  # seconds the oldest request without a first token has waited
        self.held_prefill_tokens = held_prefill_tokens  # prompts the router holds (router.hold_prefill)
        self.fleet: Fleet = fleet or NoFleet()
        self.params = replace(Params.from_config(self.cc), lent_cores=self.fleet.shares_cores)
        self.state = State()
        self.decisions: deque[ControllerDecision] = deque(maxlen=1000)
        self._snap = (buckets(ttft), sum_count(itl))
        self.backlog = PrefillBacklog()
        # As far ahead as a worker asked for now takes to land and stay: the readings that sustain
        # the condition, then the cooldown during which the fleet cannot change again.
        self.forecast = DecodeForecast(self.cc.cooldown_s + self.cc.sustain_intervals * self.cc.interval_s)
        self.m_actions = Counter(
            "pdserve_controller_actions",
            "Controller actions carried out, by action and outcome",
            ["action", "outcome"],
            registry=metrics,
        )
        self.m_pressure = Gauge(
            "pdserve_controller_pressure",
            "Pool figure over its SLO at the last reading",
            ["pool"],
            registry=metrics,
        )
        self.m_workers = Gauge(
            "pdserve_controller_workers",
            "Workers taking work, by role, at the last reading",
            ["role"],
            registry=metrics,
        )
        self.m_leader = Gauge(
            "pdserve_controller_leader",
            "1 while this router's controller may act (it holds the lease, or needs none)",
            registry=metrics,
        )

    def serving(self, role: str) -> list[Worker]:
        return [w for w in self.registry.workers.values() if w.role == role and w.healthy and not w.draining]

    def read(self, now: float) -> Reading:
        """The fleet over the interval since the last reading."""
        snap = (buckets(self.ttft), sum_count(self.itl))
        ttft = quantile_between(self._snap[0], snap[0], 0.9)
        gaps = snap[1][1] - self._snap[1][1]
        itl = (snap[1][0] - self._snap[1][0]) / gaps if gaps > 0 else None
        self._snap = snap
        pre, dec = self.serving("prefill"), self.serving("decode")
        health = [w.health for w in pre + dec if w.health is not None]
        dec_usage = [w.health.kv_usage for w in dec if w.health is not None]
        wait = self.oldest_wait(now)
        # Prompts held at the router wait too, shared out over the pool that will take them.
        held = self.held_prefill_tokens()
        backlog = self.backlog.update(
            now,
            {
                w.worker_id: (
                    w.health.prefill_tokens_computed,
                    w.queued_prefill_tokens + held / max(1, len(pre)),
                )
                for w in pre
                if w.health is not None
            },
        )
        streams = [w.health.running for w in dec if w.health is not None]
        forecast = (
            self.forecast.update(now, sum(streams) / len(streams), None if itl is None else itl * 1000)
            if streams
            else None
        )
        return Reading(
            now,
            len(pre),
            len(dec),
            None if ttft is None else ttft * 1000,
            None if itl is None else itl * 1000,
            sum(dec_usage) / len(dec_usage) if dec_usage else 0.0,
            sum(w.queued_prefill_tokens for w in pre + dec) + held,
            sum(h.running for h in health),
            sum(h.waiting for h in health),
            self.fleet.starting({w.url for w in self.registry.workers.values() if w.healthy}),
            None if wait is None else wait * 1000,
            None if backlog is None else backlog * 1000,
            forecast,
            max(1, len({w.version for w in pre + dec if w.version})),
            self.forecast.base_ms if streams else None,
        )

    async def step(self) -> ControllerDecision:
        reading = self.read(time.monotonic())
        decision, self.state = decide(reading, self.state, self.params)
        pre, dec = pressures(reading, self.params)
        self.m_pressure.labels("prefill").set(pre)
        self.m_pressure.labels("decode").set(dec)
        self.m_workers.labels("prefill").set(reading.n_prefill)
        self.m_workers.labels("decode").set(reading.n_decode)
        if not self.acting:
            self.state = State()
            return ControllerDecision(
                time=time.time(), action="hold", reason="controller.enabled is false", inputs=decision.inputs
            )
        leads = self.lease is None or self.lease.held
        self.m_leader.set(1 if leads else 0)
        if not leads:
            assert self.lease is not None
            self.state = State()  # the leader's readings, not these, decide; start afresh on taking over
            why = self.lease.describe()
            return self._record(Decision("hold", why, decision.inputs), None, why, True)
        if decision.action == "hold":
            return self._record(decision, None, decision.reason, True)
        worker, ok, reason = None, True, decision.reason
        try:
            worker = await self._carry_out(decision)
        except (SwitchRefused, RuntimeError, httpx.HTTPError) as e:
            ok, reason = False, f"{decision.reason}; failed: {e}"
            log.warning("controller: %s failed: %s", decision.action, e)
        self.m_actions.labels(decision.action, "ok" if ok else "failed").inc()
        entry = self._record(decision, worker, reason, ok)
        if ok and decision.action == "switch_to_decode" and self.cc.rebalance:
            await self._even_out(worker)
        return entry

    async def _even_out(self, joined: str | None) -> None:
        """After a worker joined the decode pool: the streams piled on the others move over, each
        recorded as a `rebalance` decision of the worker that gave them up."""
        try:
            moved = await even_out(self.registry, self.client)
        except (SwitchRefused, httpx.HTTPError) as e:
            log.warning("controller: evening out the decode pool failed: %s", e)
            self.m_actions.labels("rebalance", "failed").inc()
            self._record(
                Decision("rebalance", f"evening out the decode pool after {joined} joined it", {}),
                None,
                f"failed: {e}",
                False,
            )
            return
        for wid, n in moved.items():
            self.m_actions.labels("rebalance", "ok").inc()
            why = f"{wid} held more streams than the decode pool's mean after {joined} joined it: {n} moved"
            self._record(Decision("rebalance", why, {"moved": float(n)}), wid, why, True)

    def _record(self, d: Decision, worker: str | None, reason: str, ok: bool) -> ControllerDecision:
        entry = ControllerDecision(
            time=time.time(), action=d.action, worker=worker, reason=reason, inputs=d.inputs, ok=ok
        )
        self.decisions.append(entry)
        if d.action != "hold":
            log.info("controller: %s %s: %s", d.action, worker or "", reason)
        return entry

    async def _carry_out(self, d: Decision) -> str | None:
        verb, role = d.action.split("_", 1)[0], d.action.rsplit("_", 1)[1]
        drain_s = self.cc.drain_timeout_s
        if verb == "add":
            serving = self.serving("prefill") + self.serving("decode")
            version = fleet_version([w.version for w in serving])
            return await self.fleet.add(role, next((w for w in serving if w.version == version), None))
        source = role if verb == "remove" else ("decode" if role == "prefill" else "prefill")
        candidates = sorted(self.serving(source), key=lambda w: (w.in_flight, w.worker_id))
        if not candidates:
            raise RuntimeError(f"no {source} worker to take")
        w = candidates[0]
        if verb == "switch":
            await switch_role(self.registry, self.client, w, role, drain_s)
            return w.worker_id
        if isinstance(self.fleet, NoFleet):
            await self.fleet.remove(w)  # raises before the worker is emptied for nothing
        await empty_worker(self.registry, self.client, w, drain_s)
        try:
            await self.fleet.remove(w)
        except BaseException:
            await back_into_service(self.registry, self.client, w)  # still running
            raise
        self.registry.deregister(w.worker_id)
        return w.worker_id

    async def run(self) -> None:
        lease = asyncio.create_task(self.lease.run()) if self.lease is not None else None
        try:
            while True:
                await asyncio.sleep(self.cc.interval_s)
                try:
                    await self.step()
                except Exception:  # noqa: BLE001 - the loop outlives one bad reading
                    log.exception("controller step failed")
        finally:
            if lease is not None and self.lease is not None:
                lease.cancel()
                await self.lease.release()  # the next replica takes over at once, not after lease_s

    def describe(self) -> list[dict]:
        return [d.model_dump() for d in self.decisions]
