"""The router's figures per worker version (pdserve/version.py): what `pdserve rollout` judges a
new version by (control/rollout.py reads them from /metrics over its window).

A request counts for every version it touched: its decode workers', and its prefill worker's when
that one computed part of the prompt. TTFT runs from the request's start at the router (after
admission) to its first token (for the versions touched by then); TPOT is (last token - first
token) / (tokens - 1). A failed attempt
(the worker failed it; a hand-back by a draining worker is no failure) counts against the version
of the worker that failed it, even if a retry or a migration saved the request.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.router.accounting import Route

_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
UNKNOWN = "unknown"  # a worker that reported no version (an older one)


class VersionStats:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = Histogram(
            "pdserve_router_version_ttft_seconds",
            "Time to first token by worker version",
            ["version"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_router_version_tpot_seconds",
            "Time per output token by worker version",
            ["version"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdserve_router_version_requests",
            "Requests that reached a worker of a version",
            ["version"],
            registry=r,
        )
        self.errors = Counter(
            "pdserve_router_version_errors",
            "Attempts a worker of this version failed",
            ["version"],
            registry=r,
        )

    def request(self) -> RequestVersions:
        return RequestVersions(self)


class RequestVersions:
    """One request's versions and token times. Counted as it goes, so that a window sees the
    requests that started in it: a version when an attempt first reaches it, TTFT at the first
    token, TPOT when the request ends."""

    def __init__(self, stats: VersionStats) -> None:
        self.stats = stats
        self.start = time.monotonic()
        self.first = self.last = 0.0
        self.n = 0
        self.versions: set[str] = set()

    def attempt(self, route: Route) -> None:
        touched = {route.decode.version or UNKNOWN}
        if route.prefill is not None and route.remote_tokens:
            touched.add(route.prefill.version or UNKNOWN)
        for v in touched - self.versions:
            self.stats.requests.labels(v).inc()
        self.versions |= touched

    def failed(self, route: Route) -> None:
        self.stats.errors.labels(route.decode.version or UNKNOWN).inc()

    def tokens(self, n: int, now: float | None = None) -> None:
        if not n:
            return
        now = time.monotonic() if now is None else now
        if not self.n:
            self.first = now
            for v in self.versions:
                self.stats.ttft.labels(v).observe(now - self.start)
        self.last, self.n = now, self.n + n

    def close(self) -> None:
        if self.n > 1:
            for v in self.versions:
                self.stats.tpot.labels(v).observe((self.last - self.first) / (self.n - 1))
        self.versions = set()
