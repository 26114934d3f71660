"""The autoscaler's decisions: a pure function of one reading of the fleet, the state carried from
the readings before, and the parameters (controller: config). The controller (control/controller.py)
reads the fleet, calls `decide` and carries out what it returns; tests replay metric traces through
`decide` alone.

Pressure is a pool's figure against its SLO: the prefill pool's is the largest of TTFT p90, the
longest wait of a request still without its first token (a TTFT in the making: it is at least
that) and the backlog a prompt sent now would wait behind (the queue of prompt tokens at the
pool's measured rate: the TTFT to come, before any request has waited it) over slo_ttft_ms,
the decode pool's the larger of the mean inter-token gap, the gap forecast for a stream sent now
(the measured step cost at the streams a decode worker will hold by the time a worker asked for now
lands and stays, if they keep growing as they have: control/controller.DecodeForecast; read as the
streams pile up, before their gap crosses the SLO) over slo_tpot_ms, and
decode KV usage / kv_usage_high. (TPOT is a per-request mean, so the mean gap is what its SLO
bounds; a p90 of gaps, spiked by prefills sharing the CPU, reads ~1.3x over it: it calls a pool
that meets every request's TPOT short of workers, and never one that could spare a worker.) A
pool is hot above `high` and cold below `low`; a reading that says neither (no first token in an
interval while requests are in flight, none yet waiting past the SLO) leaves the counts as they
were. Hysteresis, so that it never flaps:
- a condition acts only when it held in `sustain_intervals` of the last `window` readings that knew
  the pool (sustain_intervals + 1 unless set), the newest among them: one reading between hot ones
  (a lull in arrivals, a slow step) does not restart the count, and noise that crosses the line
  every other reading never acts;
- a switch takes a worker from a cold pool, so the pool it leaves must be well under its SLO (not
  merely under `high`), and moving it back needs the reverse condition, sustained; only at
  `max_workers`, with nowhere else to get one, does a hot pool take a worker from a pool that is
  not cold, and only when the move is predicted to lower the worse of the two pressures (below),
  which the reverse move then cannot;
- after any action nothing happens for `cooldown_s`, nor while a worker it started has not yet
  registered; the counts start again after that.
Order of preference: a hot pool takes a worker from a cold pool (a switch costs no start-up),
else a new worker below `max_workers`; at `max_workers`, a worker moves to a hot pool when the
worse pressure predicted after the move is `switch_gain` times lower than the hot pool's now; when
both pools stay cold, one worker goes (drained first) down to `min_workers`. Each pool keeps at
least one worker.

The prediction (`pressure_after`) spreads the load-dependent part of a pool's figures over its
workers after the move: the decode gap less the step's fixed cost (the intercept of the step cost
the controller fits to this machine's readings, `Reading.decode_base_ms`; zero until measured, which
over-predicts the pool losing a worker), KV usage, and the prefill pool's waits and backlog whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

ACTIONS = (
    "hold",
    "switch_to_prefill",
    "switch_to_decode",
    "add_prefill",
    "add_decode",
    "remove_prefill",
    "remove_decode",
)


@dataclass(frozen=True)
class Params:
    """controller: config's policy keys (config.py holds their defaults and meaning)."""

    slo_ttft_ms: float
    slo_tpot_ms: float
    kv_usage_high: float
    high: float
    low: float
    sustain_intervals: int
    cooldown_s: float
    min_workers: int
    max_workers: int
    switch_gain: float
    window: int = 0  # readings a condition is counted over; 0: sustain_intervals + 1
    # The pools share one host's cores, idle workers lending their threads to decode steps
    # (utils/core_share.py): a decode gap over its SLO takes no prefill worker (below).
    lent_cores: bool = False

    @classmethod
    def from_config(cls, c) -> Params:
        return cls(
            c.slo_ttft_ms,
            c.slo_tpot_ms,
            c.kv_usage_high,
            c.high,
            c.low,
            c.sustain_intervals,
            c.cooldown_s,
            c.min_workers,
            c.max_workers,
            c.switch_gain,
        )

    @property
    def span(self) -> int:
        return max(self.window or self.sustain_intervals + 1, self.sustain_intervals)


@dataclass(frozen=True)
class Reading:
    """The fleet over one interval. Latencies are None when no request produced one in it."""

    time: float  # monotonic seconds
    n_prefill: int
    n_decode: int
    ttft_p90_ms: float | None = None
    itl_mean_ms: float | None = None  # mean gap between a stream's tokens
    decode_kv_usage: float = 0.0  # mean over the decode pool
    queued_prefill_tokens: int = 0  # the router's figure, summed over the fleet
    running: int = 0
    waiting: int = 0
    starting: int = 0  # workers started and not yet registered
    oldest_wait_ms: float | None = None  # the longest a request in flight has waited for its first token
    backlog_ms: float | None = None  # the wait ahead of a prompt sent now to the least-queued prefill worker
    itl_forecast_ms: float | None = None  # the mean gap forecast for a decode stream sent now
    versions: int = 1  # versions the serving workers run: more than one while a rollout replaces them
    decode_base_ms: float | None = None  # the decode step's fixed cost (the fitted gap at no stream)


HOT, COLD, NEITHER = 1, -1, 0


def _run(seen: tuple[int, ...], mark: int) -> int:
    """How many of the newest readings in a row were `mark`."""
    n = 0
    for m in reversed(seen):
        if m != mark:
            break
        n += 1
    return n


@dataclass(frozen=True)
class State:
    prefill_seen: tuple[
        int, ...
    ] = ()  # the prefill pool at the last readings that knew it: HOT, COLD, NEITHER
    decode_seen: tuple[int, ...] = ()
    last_action_at: float | None = None

    @property
    def prefill_hot(self) -> int:  # readings in a row with the prefill pool hot
        return _run(self.prefill_seen, HOT)

    @property
    def decode_hot(self) -> int:
        return _run(self.decode_seen, HOT)

    @property
    def prefill_cold(self) -> int:
        return _run(self.prefill_seen, COLD)

    @property
    def decode_cold(self) -> int:
        return _run(self.decode_seen, COLD)


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    inputs: dict[str, float]


def pressures(r: Reading, p: Params) -> tuple[float, float]:
    """(prefill, decode) pressure: 1.0 is a pool exactly at its SLO."""
    pre = max(r.ttft_p90_ms or 0.0, r.oldest_wait_ms or 0.0, r.backlog_ms or 0.0) / p.slo_ttft_ms
    dec = max(
        max(r.itl_mean_ms or 0.0, r.itl_forecast_ms or 0.0) / p.slo_tpot_ms,
        r.decode_kv_usage / p.kv_usage_high,
    )
    return pre, dec


def pressure_after(r: Reading, p: Params, role: str, n_after: int) -> float:
    """The pool `role`'s pressure with `n_after` workers instead of its `r.n_<role>`, its load spread
    over them: the decode gap's part above the step's fixed cost and KV usage scale with the streams
    a worker holds, the prefill pool's waits and backlog with the prompts queued at each."""
    n = r.n_prefill if role == "prefill" else r.n_decode
    share = n / max(n_after, 1)
    if role == "prefill":
        return pressures(r, p)[0] * share
    gap = max(r.itl_mean_ms or 0.0, r.itl_forecast_ms or 0.0)
    base = min(gap, max(0.0, r.decode_base_ms or 0.0))
    return max((base + (gap - base) * share) / p.slo_tpot_ms, r.decode_kv_usage * share / p.kv_usage_high)


def _move_gain(r: Reading, p: Params, role: str) -> float:
    """How many times lower the worse pool's pressure is predicted to be after a worker moves to
    `role`'s pool than `role`'s pressure now (0: the other pool has no worker to give)."""
    other = "decode" if role == "prefill" else "prefill"
    n_role = r.n_prefill if role == "prefill" else r.n_decode
    n_other = r.n_decode if role == "prefill" else r.n_prefill
    if n_other <= 1:
        return 0.0
    now = pressures(r, p)[0 if role == "prefill" else 1]
    worst = max(pressure_after(r, p, role, n_role + 1), pressure_after(r, p, other, n_other - 1))
    return now / max(worst, 1e-9)


def _mark(pressure: float, p: Params) -> int:
    return HOT if pressure > p.high else COLD if pressure < p.low else NEITHER


def _held(seen: tuple[int, ...], mark: int, p: Params) -> bool:
    """`mark` in sustain_intervals of the last `span` readings, the newest among them."""
    return bool(seen) and seen[-1] == mark and seen[-p.span :].count(mark) >= p.sustain_intervals


def decide(r: Reading, s: State, p: Params) -> tuple[Decision, State]:
    pre, dec = pressures(r, p)
    inputs = {
        "prefill_pressure": round(pre, 4),
        "decode_pressure": round(dec, 4),
        "n_prefill": r.n_prefill,
        "n_decode": r.n_decode,
        "ttft_p90_ms": r.ttft_p90_ms or 0.0,
        "itl_mean_ms": r.itl_mean_ms or 0.0,
        "decode_kv_usage": r.decode_kv_usage,
        "queued_prefill_tokens": r.queued_prefill_tokens,
        "running": r.running,
        "waiting": r.waiting,
        "starting": r.starting,
        "oldest_wait_ms": r.oldest_wait_ms or 0.0,
        "backlog_ms": round(r.backlog_ms or 0.0, 1),
        "itl_forecast_ms": round(r.itl_forecast_ms or 0.0, 1),
        "decode_base_ms": round(r.decode_base_ms or 0.0, 1),
    }
    last = s.last_action_at
    if last is not None and r.time - last < p.cooldown_s:
        # Readings while the last action settles count for nothing.
        return Decision("hold", f"cooldown: {p.cooldown_s - (r.time - last):.0f}s left", inputs), State(
            last_action_at=last
        )
    if r.starting:
        # Figures without the new worker say nothing of the fleet with it: wait for it, from zero.
        return Decision("hold", f"{r.starting} worker(s) starting", inputs), State(last_action_at=last)
    if r.versions > 1:
        # A rollout adds and retires workers itself: a removal now could take its canary or the
        # worker it is about to replace, and the figures mix two versions.
        why = f"a rollout is under way ({r.versions} versions serve)"
        return Decision("hold", why, inputs), State(last_action_at=last)
    # No latency in an idle interval: the pools are cold. No latency while requests are in flight
    # (long replies still decoding, or prompts queued behind a long prefill): that pool's reading is
    # unknown, unless it is over the SLO already (a wait or a backlog past it), and leaves its counts as they
    # were. Resetting them instead would never let a pool whose prefills take longer than an
    # interval count as hot: it has intervals without a first token however long its queue.
    busy = r.running + r.waiting + r.queued_prefill_tokens > 0
    pre_known = r.ttft_p90_ms is not None or not busy or pre > p.high
    dec_known = r.itl_mean_ms is not None or not busy or dec > p.high
    keep = max(p.span, 2 * p.sustain_intervals)  # enough for the scale-down's run of cold readings
    if pre_known:
        s = replace(s, prefill_seen=(s.prefill_seen + (_mark(pre, p),))[-keep:])
    if dec_known:
        s = replace(s, decode_seen=(s.decode_seen + (_mark(dec, p),))[-keep:])

    def hold(reason: str) -> tuple[Decision, State]:
        return Decision("hold", reason, inputs), s

    def act(action: str, reason: str) -> tuple[Decision, State]:
        return Decision(action, reason, inputs), State(last_action_at=r.time)

    total = r.n_prefill + r.n_decode
    n = p.sustain_intervals
    # A count carried through unknown readings acts only on a reading that knows that pool: the
    # figures an action weighs (and names) must be this interval's, not a guess of zero.
    pre_short, dec_short = (
        pre_known and _held(s.prefill_seen, HOT, p),
        dec_known and _held(s.decode_seen, HOT, p),
    )
    if pre_short and dec_short:
        role = "prefill" if pre >= dec else "decode"
        if total < p.max_workers:
            return act(
                f"add_{role}",
                f"both pools over their SLOs in {n} of the last {p.span} intervals ({pre:.2f}, {dec:.2f}); "
                f"the {role} pool more",
            )
        # At max_workers with both over: move a worker to the worse pool only when the worse of the
        # two pressures is predicted to fall by `switch_gain`, so the move cannot simply reverse.
        gain = _move_gain(r, p, role)
        if gain >= p.switch_gain:
            return act(
                f"switch_to_{role}",
                f"both pools over their SLOs at max_workers; a worker moved to the {role} pool is "
                f"predicted to bring the worse pressure {gain:.1f}x lower",
            )
        return hold(f"both pools over their SLOs and the fleet is at max_workers ({p.max_workers})")
    for role, short, other_cold, n_other, pressure in (
        ("prefill", pre_short, dec_known and _held(s.decode_seen, COLD, p), r.n_decode, pre),
        ("decode", dec_short, pre_known and _held(s.prefill_seen, COLD, p), r.n_prefill, dec),
    ):
        if not short:
            continue
        other = "decode" if role == "prefill" else "prefill"
        what = f"{role} pressure {pressure:.2f} over {p.high:g} in {n} of the last {p.span} intervals"
        if role == "decode" and p.lent_cores and r.decode_kv_usage / p.kv_usage_high <= p.high:
            # An idle prefill worker's threads already run the decode steps on this host: switching
            # it moves no core to the streams, only takes its core from the prompts to come (and
            # costs the switch). A decode pool short of KV still needs the worker's pool.
            if total < p.max_workers:
                return act("add_decode", f"{what}; the prefill workers' idle cores serve it already")
            return hold(
                f"{what}; the prefill workers' idle cores serve it already (deployment.share_idle_cores)"
            )
        if other_cold and n_other > 1:
            return act(f"switch_to_{role}", f"{what}; the {other} pool is under {p.low:g}")
        if total < p.max_workers:
            return act(f"add_{role}", f"{what}; no spare {other} worker")
        # At max_workers, the other pool within its SLO but not cold (a cold one gives a worker by
        # the sustained rule above): move a worker when the worse pressure after the move (each
        # pool's load spread over its workers then) is predicted `switch_gain` times lower than this
        # pool's now, so the move lowers the worse pressure and cannot simply reverse it.
        donor, donor_known = (dec, dec_known) if role == "prefill" else (pre, pre_known)
        if donor_known and _mark(donor, p) == NEITHER and n_other > 1:
            gain = _move_gain(r, p, role)
            if gain >= p.switch_gain:
                after = pressure_after(r, p, other, n_other - 1)
                return act(
                    f"switch_to_{role}",
                    f"{what}; at max_workers, the {other} pool at {donor:.2f} would be at {after:.2f} "
                    f"with one worker fewer: the worse pressure {gain:.1f}x lower",
                )
        return hold(f"{what}, but no spare {other} worker and the fleet is at max_workers ({p.max_workers})")
    if (
        pre_known
        and dec_known
        and s.prefill_cold >= 2 * n
        and s.decode_cold >= 2 * n
        and total > p.min_workers
    ):
        # Scale-down waits twice as long as scale-up: a wrong removal costs a start-up to undo.
        role = "prefill" if r.n_prefill > 1 and (r.n_prefill >= r.n_decode or r.n_decode <= 1) else "decode"
        if (r.n_prefill if role == "prefill" else r.n_decode) > 1:
            return act(
                f"remove_{role}",
                f"both pools under {p.low:g} for {2 * n} intervals; "
                f"{total} workers > min_workers ({p.min_workers})",
            )
    return hold("within the SLOs")


def fleet_version(labels: list[str | None]) -> str | None:
    """The version a worker the controller adds runs: the one most serving workers run (after a
    rollout, its new version, not the deployment's first config: a worker of the old one would
    leave the fleet mixed with no rollout to end it). None (the deployment's config) when no
    label is known or two tie."""
    counts: dict[str, int] = {}
    for label in labels:
        if label:
            counts[label] = counts.get(label, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    if not ranked or (len(ranked) > 1 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]
