"""Routing policies: pure functions of (request, worker states) -> Decision.

The gateway owns every piece of state (the round-robin counter, the RNG, the worker states and
the global KV index); a policy only reads what it is given, so tests and the simulator
(`pdserve/planner/simulate.py`) call the same functions the gateway does, without a network.

Exact ties (an idle fleet, equal loads, no cache hit) rotate with the gateway's counter instead of
going to the first worker: requests that each finish before the next arrives still spread over
the pool, where a fixed tie-break would send every one of them to the same worker.

Units: `cost` scores are prefill-token equivalents, i.e. predicted time expressed as the number
of prompt tokens a worker could prefill in it. Lower is better everywhere.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "WorkerState",
    "RouteRequest",
    "Decision",
    "CostParams",
    "DEFAULT_PARAMS",
    "available",
    "overloaded",
    "eligible",
    "round_robin",
    "least_load",
    "power_of_two",
    "cache_aware",
    "cost",
    "POLICIES",
    "choose",
    "Canary",
    "canary_pool",
]


@dataclass(frozen=True)
class WorkerState:
    worker_id: str
    role: str  # "prefill" | "decode" | "mixed"
    healthy: bool = True
    draining: bool = False
    breaker_open: bool = False  # the gateway's circuit breaker for this worker
    in_flight: int = 0  # requests the router has outstanding on it
    queued_prefill_tokens: int = 0  # prompt tokens sent to it and not yet prefilled (router's estimate)
    decode_tokens: int = 0  # tokens it is still expected to generate for in-flight requests
    kv_usage: float = 0.0  # 0..1 from its /health
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0  # 0: unknown, so free-KV checks are skipped
    capacity: int = 64  # max concurrent requests (its max_num_seqs)
    version: str | None = None  # its version label (pdserve/version.py), for canary routing


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    max_tokens: int
    block_size: int
    # worker_id -> (leading cached blocks, the tier bounding their load), from KVIndex.match
    cache_hits: Mapping[str, tuple[int, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    worker_id: str | None  # None: nobody eligible
    reason: str
    scores: Mapping[str, float] = field(default_factory=dict)


def _tier_costs() -> dict[str, float]:
    return {"device": 0.0, "host": 0.1, "disk": 0.3, "remote": 0.6}


@dataclass(frozen=True)
class CostParams:
    """Weights and thresholds. docs/routing.md explains each default and how it was tuned."""

    # Fraction of the recompute time a cached token still costs, by the slowest tier its prefix
    # loads from. Device KV is resident; the others pay a copy (PCIe, disk, network).
    tier_cost: Mapping[str, float] = field(default_factory=_tier_costs)
    # Prefill-token equivalents per token a worker still has to generate. It keeps decode-heavy
    # workers from taking every request that shares their prefix (decode work follows routing).
    decode_weight: float = 0.25
    # Added to the predicted TTFT per uncached token: recompute is paid again by every request that
    # queues behind it and it takes cache space from other prefixes, where waiting costs only this
    # request. Without it `cost` spreads hot prefixes too eagerly (docs/routing.md).
    recompute_weight: float = 5.0
    # The per-worker overload gate: a worker past any of these takes no new request.
    max_kv_usage: float = 0.95
    max_queued_prefill_tokens: int | None = None  # None: no bound besides capacity
    # Length-aware routing: a prompt this long pays long_prompt_kv_weight * its length * kv_usage,
    # steering it to workers with free KV (it would otherwise wait for memory or preempt).
    long_prompt_tokens: int = 4096
    long_prompt_kv_weight: float = 1.0
    # cache_aware (SGLang-style): route by prefix unless the fleet is imbalanced.
    cache_threshold: float = 0.3  # min fraction of the prompt cached to follow the cache
    balance_abs_threshold: int = 32  # in_flight spread that counts as imbalanced...
    balance_rel_threshold: float = 1.5  # ...when the busiest also has this many times the idlest


DEFAULT_PARAMS = CostParams()


# ------------------------------------------------------------------ eligibility


def available(w: WorkerState) -> bool:
    """Up and accepting work: healthy, not draining, breaker closed."""
    return w.healthy and not w.draining and not w.breaker_open


def overloaded(w: WorkerState, params: CostParams | None = None) -> bool:
    """This worker's own gate; each worker is judged alone, never the fleet as a whole."""
    p = params or DEFAULT_PARAMS
    if w.in_flight >= w.capacity or w.kv_usage >= p.max_kv_usage:
        return True
    return p.max_queued_prefill_tokens is not None and w.queued_prefill_tokens >= p.max_queued_prefill_tokens


def eligible(workers: Sequence[WorkerState], params: CostParams | None = None) -> list[WorkerState]:
    p = params or DEFAULT_PARAMS
    return [w for w in workers if available(w) and not overloaded(w, p)]


@dataclass(frozen=True)
class Canary:
    """During a rollout: this share of new requests goes to workers of `version` first."""

    version: str
    weight: float  # 0..1


def canary_pool(workers: Sequence[WorkerState], canary: Canary | None, draw: float) -> Sequence[WorkerState]:
    """The workers a request may go to under a canary: those of the canary version when `draw`
    (uniform in [0, 1), one per request, the same for its prefill and decode picks) is below the
    weight, the others otherwise; either group with no eligible worker gives way to the other, so a
    canary never refuses a request one version could take. Pools with one version only are left whole."""
    if canary is None:
        return workers
    new = [w for w in workers if w.version == canary.version]
    if not new or len(new) == len(workers):
        return workers
    old = [w for w in workers if w.version != canary.version]
    first, then = (new, old) if draw < canary.weight else (old, new)
    return first if eligible(first) else then


def _nobody(workers: Sequence[WorkerState]) -> Decision:
    # "overloaded" tells the gateway to queue or shed (429/503); "no_workers" means none is up.
    return Decision(None, "overloaded" if any(available(w) for w in workers) else "no_workers")


def _outstanding(w: WorkerState) -> int:
    return w.queued_prefill_tokens + w.decode_tokens


def _rotated(cands: Sequence[WorkerState], counter: int) -> list[tuple[int, WorkerState]]:
    """(position after rotating by counter, worker): the last key of every tie-break."""
    n = len(cands)
    return [((i - counter) % n, w) for i, w in enumerate(cands)]


# ------------------------------------------------------------------ load-only policies


def round_robin(req: RouteRequest, workers: Sequence[WorkerState], counter: int) -> Decision:
    """The counter-th eligible worker, cyclically: ineligible ones are skipped, not queued for."""
    cands = eligible(workers)
    if not cands:
        return _nobody(workers)
    return Decision(cands[counter % len(cands)].worker_id, "round_robin")


def least_load(
    req: RouteRequest, workers: Sequence[WorkerState], params: CostParams | None = None, counter: int = 0
) -> Decision:
    """Fewest outstanding tokens (queued prefill + expected decode); KV usage, then in flight,
    then the rotation break ties."""
    cands = eligible(workers, params)
    if not cands:
        return _nobody(workers)
    _, best = min(
        _rotated(cands, counter), key=lambda rw: (_outstanding(rw[1]), rw[1].kv_usage, rw[1].in_flight, rw[0])
    )
    return Decision(best.worker_id, "least_load", {w.worker_id: float(_outstanding(w)) for w in cands})


def power_of_two(
    req: RouteRequest, workers: Sequence[WorkerState], rng: random.Random, params: CostParams | None = None
) -> Decision:
    """Two distinct random eligible workers, the lighter one wins (the first on a tie)."""
    cands = eligible(workers, params)
    if not cands:
        return _nobody(workers)
    if len(cands) == 1:
        return Decision(
            cands[0].worker_id, "power_of_two", {cands[0].worker_id: float(_outstanding(cands[0]))}
        )
    a, b = rng.sample(cands, 2)

    def key(w: WorkerState) -> tuple:
        return (_outstanding(w), w.kv_usage, w.in_flight)

    best = b if key(b) < key(a) else a
    return Decision(
        best.worker_id,
        "power_of_two",
        {a.worker_id: float(_outstanding(a)), b.worker_id: float(_outstanding(b))},
    )


# ------------------------------------------------------------------ cache-aware policies


def cache_aware(
    req: RouteRequest, workers: Sequence[WorkerState], params: CostParams | None = None, counter: int = 0
) -> Decision:
    """SGLang's recipe on the global index: while in_flight is balanced, the worker with the most
    cached leading blocks (ties: fewer in flight) if that covers cache_threshold of the prompt,
    else the least loaded; when imbalanced, the least loaded whatever the cache says."""
    p = params or DEFAULT_PARAMS
    cands = eligible(workers, p)
    if not cands:
        return _nobody(workers)
    _, idlest = min(
        _rotated(cands, counter), key=lambda rw: (rw[1].in_flight, _outstanding(rw[1]), rw[1].kv_usage, rw[0])
    )
    busiest = max(w.in_flight for w in cands)
    lo = idlest.in_flight
    if busiest - lo > p.balance_abs_threshold and busiest > p.balance_rel_threshold * lo:
        return Decision(idlest.worker_id, "balance")
    hits = req.cache_hits
    best, best_blocks = None, 0
    for w in cands:
        h = hits.get(w.worker_id)
        if h is not None and (
            h[0] > best_blocks or (h[0] == best_blocks and best is not None and w.in_flight < best.in_flight)
        ):
            best, best_blocks = w, h[0]
    scores = {wid: float(h[0]) for wid, h in hits.items()}
    if best is not None and best_blocks * req.block_size >= p.cache_threshold * req.num_prompt_tokens:
        return Decision(best.worker_id, "cache_hit", scores)
    return Decision(idlest.worker_id, "least_load", scores)


def cost(
    req: RouteRequest, workers: Sequence[WorkerState], params: CostParams | None = None, counter: int = 0
) -> Decision:
    """The worker with the lowest
        queued prefill + (1 + recompute_weight) * uncached + decode_weight * decode tokens
        (+ long_prompt_kv_weight * prompt * kv_usage for long prompts),
    where queued prefill + uncached is the predicted TTFT and a cached token counts as the
    tier_cost fraction of an uncached one. Workers short of free KV for the whole request rank
    after all others; ties go to fewer in flight, then to the first in the rotation by counter.

    One flat loop on purpose: the gateway runs it per request over the whole pool, and 1000
    workers must take well under a millisecond."""
    p = params or DEFAULT_PARAMS
    n = req.num_prompt_tokens
    bs = req.block_size
    hits = req.cache_hits
    tier_cost = p.tier_cost
    dw = p.decode_weight
    uw = 1.0 + p.recompute_weight
    kv_pen = p.long_prompt_kv_weight * n if n >= p.long_prompt_tokens else 0.0
    need_blocks = -(-(n + req.max_tokens) // bs)
    max_hit = max(n - 1, 0)  # the last prompt token is always computed, for its logits
    max_kv = p.max_kv_usage
    max_q = p.max_queued_prefill_tokens
    base = uw * n
    scores: dict[str, float] = {}
    best: WorkerState | None = None  # spill: the best among workers short of free KV
    spill: WorkerState | None = None
    best_c = spill_c = float("inf")
    best_r = spill_r = 0  # their rotated positions, read only on an exact tie
    nw = len(workers) or 1
    up = False
    for i, w in enumerate(workers):
        if not w.healthy or w.draining or w.breaker_open:
            continue
        up = True
        q = w.queued_prefill_tokens
        if w.in_flight >= w.capacity or w.kv_usage >= max_kv or (max_q is not None and q >= max_q):
            continue
        wid = w.worker_id
        c = base + q + dw * w.decode_tokens
        need = need_blocks
        h = hits.get(wid)
        if h is not None:
            frac = tier_cost.get(h[1], 1.0)
            c -= uw * (1.0 - frac) * min(h[0] * bs, max_hit)
            if frac == 0.0:
                need -= h[0]  # resident blocks need no new KV
        if kv_pen:
            c += kv_pen * w.kv_usage
        scores[wid] = c
        r = (i - counter) % nw
        if w.kv_total_blocks and w.kv_free_blocks < need:
            # an exact tie means the cost is finite, so spill (best below) was set
            if c < spill_c or (
                c == spill_c and spill is not None and (w.in_flight, r) < (spill.in_flight, spill_r)
            ):
                spill, spill_c, spill_r = w, c, r
        elif c < best_c or (c == best_c and best is not None and (w.in_flight, r) < (best.in_flight, best_r)):
            best, best_c, best_r = w, c, r
    best = best or spill
    if best is None:
        return Decision(None, "overloaded" if up else "no_workers")
    return Decision(best.worker_id, "cost", scores)


# ------------------------------------------------------------------ dispatch

POLICIES: dict[str, Callable[..., Decision]] = {
    "round_robin": round_robin,
    "least_load": least_load,
    "power_of_two": power_of_two,
    "cache_aware": cache_aware,
    "cost": cost,
}


def choose(
    name: str,
    req: RouteRequest,
    workers: Sequence[WorkerState],
    *,
    counter: int = 0,
    rng: random.Random | None = None,
    params: CostParams | None = None,
) -> Decision:
    """Run the policy called `name`, handing it only the state it reads (the counter: a
    round-robin position, and every other policy's tie rotation)."""
    if name == "round_robin":
        return round_robin(req, workers, counter)
    if name == "power_of_two":
        if rng is None:
            raise ValueError("power_of_two needs rng= (a seeded random.Random the gateway keeps)")
        return power_of_two(req, workers, rng, params)
    try:
        fn = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
    return fn(req, workers, params, counter)
