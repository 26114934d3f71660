"""The pure parts of a rollout (control/rollout.py): the canary weight of each step, and the SLO
verdict on the new version over a window, from two readings of the router's /metrics
(router/version_stats.py: TTFT and TPOT histograms, requests and failed attempts by version).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdserve.control.controller import quantile_between

_PREFIX = "pdserve_router_version_"


@dataclass(frozen=True)
class Slo:
    ttft_ms: float  # p90 over the window
    tpot_ms: float  # p90 over the window
    max_error_rate: float  # failed attempts / requests over the window


@dataclass(frozen=True)
class Reading:
    """One version's cumulative figures at one moment."""

    ttft: list[tuple[float, float]] = field(default_factory=list)  # (upper bound s, count)
    tpot: list[tuple[float, float]] = field(default_factory=list)
    requests: float = 0.0
    errors: float = 0.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    requests: int = 0
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None
    error_rate: float | None = None


def read(metrics_text: str, version: str) -> Reading:
    """`version`'s figures in a Prometheus text exposition of the router's /metrics."""
    buckets: dict[str, list[tuple[float, float]]] = {"ttft": [], "tpot": []}
    counts = {"requests": 0.0, "errors": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        if not family.name.startswith(_PREFIX):
            continue
        kind = family.name[len(_PREFIX) :].removesuffix("_seconds")
        for s in family.samples:
            if s.labels.get("version") != version:
                continue
            if kind in buckets and s.name.endswith("_bucket"):
                buckets[kind].append((float(s.labels["le"]), s.value))
            elif kind in counts and s.name.endswith("_total"):
                counts[kind] += s.value
    return Reading(sorted(buckets["ttft"]), sorted(buckets["tpot"]), counts["requests"], counts["errors"])


def judge(before: Reading, after: Reading, slo: Slo) -> Verdict:
    """The new version over the window between two readings: p90 TTFT and TPOT against the SLO,
    the share of failed attempts against max_error_rate. No request in the window: nothing to
    judge, so it passes (and says so)."""
    n = after.requests - before.requests
    errors = after.errors - before.errors
    if n <= 0 and errors <= 0:
        return Verdict(True, "no request reached the new version in the window")
    rate = errors / max(n, errors)
    ttft = quantile_between(before.ttft, after.ttft, 0.9)
    tpot = quantile_between(before.tpot, after.tpot, 0.9)
    ttft_ms = None if ttft is None else ttft * 1000
    tpot_ms = None if tpot is None else tpot * 1000
    breaches = []
    if rate > slo.max_error_rate:
        breaches.append(f"error rate {rate:.3f} > {slo.max_error_rate:g}")
    if ttft_ms is not None and ttft_ms > slo.ttft_ms:
        breaches.append(f"TTFT p90 {ttft_ms:.1f} ms > {slo.ttft_ms:g} ms")
    if tpot_ms is not None and tpot_ms > slo.tpot_ms:
        breaches.append(f"TPOT p90 {tpot_ms:.1f} ms > {slo.tpot_ms:g} ms")
    if breaches:
        return Verdict(False, "SLO breach: " + ", ".join(breaches), int(n), ttft_ms, tpot_ms, rate)
    return Verdict(True, f"within the SLOs over {int(n)} requests", int(n), ttft_ms, tpot_ms, rate)


def canary_weight(step: int, total: int, first: float) -> float:
    """The canary weight while the new version's `step`-th worker (0-based) of `total` is judged:
    `first` for the first one, widening linearly towards 1 as workers are replaced."""
    return first + (1.0 - first) * step / total if total > 0 else 1.0
