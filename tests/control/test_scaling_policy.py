"""The autoscaler's policy on replayed metric traces (a pure function: no processes, no clocks).

Each trace is a list of readings one interval apart; `replay` carries the state through `decide`
and applies each action to the fleet's counts, as the controller would once it is carried out."""

from __future__ import annotations

from pdserve.config import ControllerConfig
from pdserve.control.scaling_policy import ACTIONS, Decision, Params, Reading, State, decide, pressure_after

P = Params.from_config(
    ControllerConfig(
        slo_ttft_ms=1000,
        slo_tpot_ms=100,
        high=1.0,
        low=0.5,
        sustain_intervals=3,
        cooldown_s=20,
        min_workers=2,
        max_workers=4,
        kv_usage_high=0.9,
        switch_gain=1.25,
    )
)
INTERVAL = 5.0


def replay(
    trace: list[tuple[float | None, float | None]],
    n_prefill: int = 1,
    n_decode: int = 2,
    params: Params = P,
    kv: float = 0.0,
) -> list[tuple[int, str]]:
    """trace: (ttft p90 ms, itl p90 ms) per interval. Returns (interval, action) of every non-hold."""
    state, acted = State(), []
    for i, (ttft, itl) in enumerate(trace):
        d, state = decide(Reading(i * INTERVAL, n_prefill, n_decode, ttft, itl, kv), state, params)
        assert d.action in ACTIONS and d.reason
        if d.action == "hold":
            continue
        acted.append((i, d.action))
        verb, role = d.action.split("_", 1)[0], d.action.rsplit("_", 1)[1]
        if verb == "switch":
            n_prefill, n_decode = (
                (n_prefill + 1, n_decode - 1) if role == "prefill" else (n_prefill - 1, n_decode + 1)
            )
        elif verb == "add":
            n_prefill, n_decode = (
                (n_prefill + 1, n_decode) if role == "prefill" else (n_prefill, n_decode + 1)
            )
        else:
            n_prefill, n_decode = (
                (n_prefill - 1, n_decode) if role == "prefill" else (n_prefill, n_decode - 1)
            )
        assert (
            n_prefill >= 1
            and n_decode >= 1
            and params.min_workers <= n_prefill + n_decode <= params.max_workers
        )
    return acted


def decide_all(
    readings: list[Reading], state: State | None = None, params: Params = P
) -> tuple[list[Decision], State]:
    """Each reading's decision, the state carried through (readings given whole, not as a trace)."""
    decisions, state = [], state or State()
    for r in readings:
        d, state = decide(r, state, params)
        decisions.append(d)
    return decisions, state


def actions(decisions: list[Decision]) -> list[tuple[int, str]]:
    """(index, action) of every non-hold."""
    return [(i, d.action) for i, d in enumerate(decisions) if d.action != "hold"]


def test_noise_around_the_threshold_never_acts():
    # TTFT jitters across the SLO every other interval; decode is idle throughout.
    trace = [(1100.0 if i % 2 else 900.0, 20.0) for i in range(60)]
    assert replay(trace) == []
    # Two readings over, two under, repeated: never three of the last four (sustain 3, window 4).
    trace = [(1200.0, 20.0), (1300.0, 20.0), (800.0, 20.0), (700.0, 20.0)] * 15
    assert replay(trace) == []


def test_one_reading_under_between_hot_ones_does_not_restart_the_count():
    # Over the SLO in two of every three readings (a lull in arrivals between): three of the last
    # four, the newest over, is sustained pressure (consecutive counting restarted at each lull).
    trace = [(1200.0, 20.0), (1300.0, 20.0), (900.0, 20.0)] * 4
    assert replay(trace, n_prefill=1, n_decode=3)[0] == (3, "switch_to_prefill")
    assert replay(trace[:3], n_prefill=1, n_decode=3) == []


def test_a_condition_acts_only_on_a_reading_that_shows_it():
    # Prefill hot three readings running while the decode pool turns cold (busy at first: no worker
    # to spare yet), then prefill at 0.9 just as decode's cold is sustained: three hot of the last
    # four, but the newest prefill reading is not hot, so it holds; the next hot reading acts.
    ttft = [1500.0, 1500.0, 1500.0, 900.0, 1500.0]
    itl = [70.0, 20.0, 20.0, 20.0, 20.0]
    decisions, _ = decide_all([Reading(i * INTERVAL, 1, 3, t, g) for i, (t, g) in enumerate(zip(ttft, itl))])
    assert actions(decisions) == [(4, "switch_to_prefill")]


def test_sustained_prefill_pressure_takes_a_cold_decode_worker_once_then_cools_down():
    trace = [(2000.0, 20.0)] * 12
    # Three hot readings -> a switch at interval 2; the pressure stays (the new worker is warming
    # up) but the cooldown (20 s = 4 intervals) holds, then the counts start again from zero.
    acted = replay(trace, n_prefill=1, n_decode=3)
    assert acted[0] == (2, "switch_to_prefill")
    assert all(b - a >= 4 + 3 - 1 for (a, _), (b, _) in zip(acted, acted[1:])), acted


def test_no_spare_decode_worker_adds_one_below_max_and_holds_at_max():
    hot_both_ways = [(2000.0, 90.0)] * 6  # decode is busy (not cold): nothing to take from it
    assert replay(hot_both_ways, n_prefill=1, n_decode=2) == [(2, "add_prefill")]
    assert replay(hot_both_ways, n_prefill=2, n_decode=2) == []  # at max_workers: hold


def test_phase_shifts_move_workers_back_and_forth_without_flapping():
    prompt_heavy = [(2500.0, 30.0)] * 10
    gen_heavy = [(200.0, 250.0)] * 10
    acted = replay(
        prompt_heavy + gen_heavy + prompt_heavy,
        n_prefill=1,
        n_decode=2,
        params=Params(**{**P.__dict__, "max_workers": 3}),
    )
    assert [a for _, a in acted] == ["switch_to_prefill", "switch_to_decode", "switch_to_prefill"], acted
    # Each switch comes 3 readings into its phase (sustain), never within the cooldown of another.
    assert [i for i, _ in acted] == [2, 12, 22]


def test_where_idle_workers_lend_their_cores_a_decode_gap_takes_no_prefill_worker():
    """One host whose idle workers' threads run the decode steps (utils/core_share.py): the same
    phase shifts move a worker to prefill and leave it there, since a prefill worker switched to decode
    would only take its core from the prompts; a decode pool short of KV still takes one."""
    lent = Params(**{**P.__dict__, "max_workers": 3, "lent_cores": True})
    prompt_heavy = [(2500.0, 30.0)] * 10
    gen_heavy = [(200.0, 250.0)] * 10
    acted = replay(prompt_heavy + gen_heavy + prompt_heavy, n_prefill=1, n_decode=2, params=lent)
    assert acted == [(2, "switch_to_prefill")], acted
    assert replay([(100.0, 10.0)] * 5, n_prefill=2, n_decode=1, kv=0.95, params=lent) == [
        (2, "switch_to_decode")
    ]
    # Below max_workers a decode gap still adds a worker (no worker moves).
    below = Params(**{**P.__dict__, "max_workers": 4, "lent_cores": True})
    assert replay(gen_heavy, n_prefill=2, n_decode=1, params=below) == [(2, "add_decode")]


def test_scale_down_waits_twice_as_long_and_stops_at_min_workers():
    idle = [(None, None)] * 40
    acted = replay(idle, n_prefill=2, n_decode=2)
    assert [a for _, a in acted] == ["remove_prefill", "remove_decode"], acted
    assert acted[0][0] == 5  # 2 x sustain readings
    # Back at min_workers (2): nothing more, however long it stays idle.
    assert replay(idle, n_prefill=1, n_decode=1) == []


def test_kv_usage_counts_as_decode_pressure():
    trace = [(100.0, 10.0)] * 5
    assert replay(trace, n_prefill=2, n_decode=1, kv=0.95) == [(2, "switch_to_decode")]
    assert replay(trace, n_prefill=2, n_decode=1, kv=0.5) == []


def test_nothing_more_while_a_started_worker_has_not_registered():
    hot = Reading(0.0, 1, 1, 5000.0, 500.0)
    state = State()
    actions = []
    for i in range(40):
        # The fleet stays hot; the worker added first takes 20 readings to register.
        starting = 1 if actions and i < 20 else 0
        n_decode = 2 if actions and i >= 20 else 1
        d, state = decide(
            Reading(i * INTERVAL, 1, n_decode, hot.ttft_p90_ms, hot.itl_mean_ms, starting=starting), state, P
        )
        if d.action != "hold":
            actions.append((i, d.action))
        elif starting:
            assert "starting" in d.reason or "cooldown" in d.reason
    # One add at the third hot reading; nothing while it starts; then the counts start from zero.
    assert actions[0] == (2, "add_prefill")
    assert all(i >= 20 + 3 - 1 for i, _ in actions[1:]), actions


def test_nothing_while_a_rollout_runs_two_versions():
    """Hot or cold, the fleet is the rollout's while two versions serve; the counts go on after."""
    for ttft, itl, n in ((5000.0, 500.0, 2), (None, None, 4)):  # hot: add; cold with spares: remove
        state = State()
        actions = []
        for i in range(30):
            versions = 2 if i < 15 else 1
            r = Reading(i * INTERVAL, n // 2 or 1, n // 2 or 1, ttft, itl, versions=versions)
            d, state = decide(r, state, P)
            if d.action != "hold":
                actions.append(i)
            elif versions > 1:
                assert "rollout" in d.reason, d.reason
        assert actions and actions[0] >= 15, actions


def test_controller_config_is_checked_at_load(tmp_path):
    import subprocess
    import sys

    import pytest

    from pdserve.config import ConfigError, load_config

    assert load_config().controller.enabled is False  # off by default
    for overrides, key, needle in (
        ({"controller.backend": "nomad"}, "controller.backend", "local, kubernetes"),
        ({"controller.min_workers": 4, "controller.max_workers": 3}, "controller.min_workers", "max_workers"),
        ({"controller.low": 1.0, "controller.high": 1.0}, "controller.low", "low < high"),
        ({"controller.sustain_intervals": 0}, "controller.sustain_intervals", "at least 1"),
        ({"controller.kv_usage_high": 1.5}, "controller.kv_usage_high", "from 0 to 1"),
        ({"controller.interval_s": 0}, "controller.interval_s", "above 0"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        [(k, msg)] = e.value.problems
        assert k == key and needle in msg, (k, msg)
    f = tmp_path / "c.yaml"
    f.write_text("controller:\n  enabled: true\n  min_workers: 5\n  max_workers: 3\n")
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--config", str(f), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "controller.min_workers" in r.stderr and "Traceback" not in r.stderr


def test_at_max_workers_with_both_pools_over_a_far_worse_pool_takes_a_worker():
    at_max = Params(**{**P.__dict__, "max_workers": 3})
    # Prefill 5x over, decode 1.2x over, fleet full: the decode pool gives one up, once, then cools down.
    assert replay([(5000.0, 120.0)] * 8, n_prefill=1, n_decode=2, params=at_max) == [(2, "switch_to_prefill")]
    # Both over by about as much: nothing to gain, hold.
    assert replay([(2000.0, 150.0)] * 20, n_prefill=1, n_decode=2, params=at_max) == []
    # Decode 9x over: a prefill worker moves, but only while the prefill pool has one to spare.
    assert replay([(1200.0, 900.0)] * 20, n_prefill=2, n_decode=1, params=at_max) == [(2, "switch_to_decode")]
    assert replay([(1200.0, 900.0)] * 20, n_prefill=1, n_decode=2, params=at_max) == []


def test_at_max_workers_a_hot_pool_takes_a_worker_when_the_worse_pressure_is_predicted_lower():
    """A prompt-heavy phase with the fleet full (1 prefill, 2 decode workers): prefill 4.5x over its
    SLO, decode at 0.6 (within it, not cold). After a move the prefill load is spread over two workers
    (2.25) and the decode load over one (1.2): the worse pressure 2x lower, so a decode worker moves,
    once. Prefill 1.5x over with decode at 0.9: decode would be at 1.8, worse than 1.5 now: hold."""
    at_max = Params(**{**P.__dict__, "max_workers": 3})
    assert replay([(4500.0, 60.0)] * 8, n_prefill=1, n_decode=2, params=at_max) == [(2, "switch_to_prefill")]
    assert replay([(4500.0, 90.0)] * 8, n_prefill=1, n_decode=2, params=at_max) == [(2, "switch_to_prefill")]
    assert replay([(1500.0, 90.0)] * 8, n_prefill=1, n_decode=2, params=at_max) == []
    # The same for a decode pool far over with the prefill pool within its SLO.
    assert replay([(700.0, 500.0)] * 8, n_prefill=2, n_decode=1, params=at_max) == [(2, "switch_to_decode")]
    # A pool of one worker gives none.
    assert replay([(4500.0, 60.0)] * 8, n_prefill=2, n_decode=1, params=at_max) == []


def test_the_decode_step_s_measured_fixed_cost_does_not_spread_over_the_workers():
    """The gap's part that is the step's fixed cost (the fitted intercept) stays whatever the streams
    a worker holds; only the rest spreads. Decode at 90 ms of a 100 ms SLO on two workers, 60 ms of it
    fixed: with one worker, 60 + 2 x 30 = 120 ms (1.2), not 180 ms; prefill at 1.6 then moves a worker
    (the worse pressure 1.33x lower, over the 1.25 asked for), where without the measured cost the
    decode pool would be at 1.8 and it holds."""
    at_max = Params(**{**P.__dict__, "max_workers": 3})

    def readings(base):
        return [Reading(i * INTERVAL, 1, 2, 1600.0, 90.0, running=6, decode_base_ms=base) for i in range(8)]

    r = readings(60.0)[0]
    assert abs(pressure_after(r, at_max, "decode", 1) - 1.2) < 1e-9
    assert abs(pressure_after(r, at_max, "prefill", 2) - 0.8) < 1e-9
    assert actions(decide_all(readings(60.0), params=at_max)[0]) == [(2, "switch_to_prefill")]
    assert actions(decide_all(readings(None), params=at_max)[0]) == []
    # KV usage spreads whole: 0.6 of the pool's blocks on two workers is 1.2 on one (over 0.9: 1.33).
    kv = Reading(0.0, 1, 2, 1500.0, 10.0, 0.6, decode_base_ms=5.0)
    assert abs(pressure_after(kv, at_max, "decode", 1) - 1.2 / 0.9) < 1e-9


def test_an_interval_without_first_tokens_under_load_is_not_a_cold_prefill_pool():
    # Long replies decode (ITL over its SLO); no new request, so no first token: TTFT unknown.
    # The fleet is at max_workers: only a switch could help, and nothing says prefill is idle.
    decisions, _ = decide_all([Reading(i * INTERVAL, 2, 2, None, 250.0, running=6) for i in range(12)])
    assert actions(decisions) == []
    # With first tokens well under the SLO the prefill pool is cold: it gives the decode pool a worker.
    assert replay([(100.0, 250.0)] * 4, n_prefill=2, n_decode=2) == [(2, "switch_to_decode")]


def test_prefills_longer_than_an_interval_still_count_as_a_hot_pool():
    # A prompt-heavy phase where each prefill takes two intervals: every other reading has no first
    # token (TTFT unknown) while prompts queue. The unknown readings neither count nor break the run.
    decisions, _ = decide_all(
        [Reading(i * INTERVAL, 1, 3, 2500.0 if i % 2 else None, 20.0, running=2, waiting=4) for i in range(8)]
    )
    assert actions(decisions) == [(5, "switch_to_prefill")]  # the third hot reading, none contrary between
    # Cold readings as often as hot ones (two of each in turn): never three of the last four, noise never acts.
    decisions, _ = decide_all(
        [
            Reading(i * INTERVAL, 1, 3, ttft, 20.0, running=2, waiting=4)
            for i, ttft in enumerate(
                [2500.0, None, 2500.0, 300.0, 300.0, 2500.0, None, 2500.0, 300.0, 300.0] * 3
            )
        ]
    )
    assert actions(decisions) == []


def test_a_wait_for_a_first_token_past_the_slo_is_prefill_pressure_before_any_first_token():
    # Prompts queue behind one another: no first token comes for a while, but the oldest request has
    # waited past the TTFT SLO already, so the pool is hot without waiting for it to finish.
    readings = [
        Reading(
            i * INTERVAL,
            1,
            3,
            None,
            20.0,
            running=2,
            waiting=6,
            queued_prefill_tokens=3600,
            oldest_wait_ms=1200.0 + 1000.0 * i,
        )
        for i in range(6)
    ]
    decisions, _ = decide_all(readings)
    assert all(d.inputs["oldest_wait_ms"] == r.oldest_wait_ms for d, r in zip(decisions, readings))
    assert actions(decisions) == [(2, "switch_to_prefill")]
    # Waits under the SLO without a first token say nothing: neither hot nor a cold pool to take from.
    state = State()
    for i in range(12):
        r = Reading(i * INTERVAL, 2, 2, None, 250.0, running=6, waiting=2, oldest_wait_ms=400.0)
        d, state = decide(r, state, P)
        assert d.action == "hold" and state.prefill_cold == 0 and state.prefill_hot == 0
    # A wait as long as the SLO with first tokens well under it: the wait counts (the larger one).
    d, _ = decide(Reading(0.0, 1, 3, 100.0, 20.0, running=1, oldest_wait_ms=3000.0), State(), P)
    assert d.inputs["prefill_pressure"] == 3.0


def test_the_controller_reads_the_mean_gap_and_the_oldest_wait_for_a_first_token():
    from prometheus_client import CollectorRegistry, Histogram

    from pdserve.control.controller import sum_count
    from pdserve.server.metrics import RequestTimer, ServerMetrics

    h = Histogram("gaps_seconds", "gaps", buckets=(0.1, 1.0), registry=CollectorRegistry())
    before = sum_count(h)
    for gap in (0.05, 0.05, 0.05, 0.85):  # p90 in the top bucket; the mean is what TPOT bounds
        h.observe(gap)
    total, n = (a - b for a, b in zip(sum_count(h), before))
    assert n == 4 and abs(total / n - 0.25) < 1e-9
    timer = RequestTimer(ServerMetrics(dict))
    assert timer.oldest_wait(10.0) is None
    timer.start("a", 1.0)
    timer.start("b", 4.0)
    assert timer.oldest_wait(10.0) == 9.0
    timer.first["a"] = 2.0  # "a" has its first token: "b" is the oldest waiting
    assert timer.oldest_wait(10.0) == 6.0


def test_a_count_carried_through_unknown_readings_acts_only_on_a_reading_that_knows_the_pool():
    # Both pools hot for three readings at max_workers (balanced: hold), then prefill goes unknown
    # (no first token, no wait past the SLO) while decode stays hot. The carried prefill count must
    # not make prefill's unknown figure (read as 0) look "far less over" and move a worker to decode.
    readings = [Reading(i * INTERVAL, 2, 2, 2000.0, 200.0, running=4) for i in range(3)]
    readings += [
        Reading((3 + i) * INTERVAL, 2, 2, None, 200.0, running=4, oldest_wait_ms=300.0) for i in range(6)
    ]
    decisions, state = decide_all(readings)
    assert actions(decisions) == []
    assert state.prefill_hot == 3  # carried, not reset, for when prefill is known again
    # Prefill known again and cold: now decode's sustained heat takes a prefill worker.
    decisions, _ = decide_all(
        [Reading((9 + i) * INTERVAL, 2, 2, 200.0, 200.0, running=4) for i in range(3)], state
    )
    assert actions(decisions) == [(2, "switch_to_decode")]


def test_a_prefill_backlog_past_the_slo_is_pressure_before_any_request_waited_it():
    # A prompt-heavy phase building: first tokens still come under the SLO (prompts sent before the
    # queue grew) and no request has yet waited past it, but the queue ahead of a prompt sent now
    # takes longer than the SLO at the pool's rate: the TTFT to come. It acts on the queue, three
    # readings in, where first tokens and waits would only cross the SLO a queue's length later.
    readings = [
        Reading(
            i * INTERVAL,
            1,
            3,
            800.0,
            20.0,
            running=3,
            waiting=4,
            queued_prefill_tokens=1500,
            oldest_wait_ms=900.0,
            backlog_ms=1500.0 + 300.0 * i,
        )
        for i in range(6)
    ]
    decisions, _ = decide_all(readings)
    assert all(d.inputs["backlog_ms"] == r.backlog_ms for d, r in zip(decisions, readings))
    assert actions(decisions) == [(2, "switch_to_prefill")]
    # A backlog under the SLO says nothing more than the first tokens do.
    decisions, _ = decide_all(
        [Reading(i * INTERVAL, 1, 3, 800.0, 20.0, running=3, backlog_ms=900.0) for i in range(12)]
    )
    assert actions(decisions) == []


def test_the_prefill_backlog_is_the_least_queue_at_the_measured_rate():
    from pdserve.control.controller import PrefillBacklog

    b = PrefillBacklog()
    assert b.update(0.0, {"p1": (0, 900)}) is None  # nothing measured yet
    # Busy throughout (queued at both readings): 600 tokens in 2 s, then 300 in 2 s -> 4 s / 900 tokens.
    assert b.update(2.0, {"p1": (600, 900)}) == 900 * 2.0 / 600
    got = b.update(4.0, {"p1": (900, 1500), "p2": (0, 300)})  # p2 just joined: no sample from it yet
    assert got is not None and abs(got - 300 * 4.0 / 900) < 1e-9  # the least-queued worker's queue
    # An idle interval (nothing queued before) is no measure of the rate; a prompt longer than an
    # interval (no tokens done, queued throughout) is busy time.
    b = PrefillBacklog()
    b.update(0.0, {"p1": (0, 0)})
    assert b.update(2.0, {"p1": (300, 300)}) is None
    b.update(4.0, {"p1": (300, 600)})  # queued at both, 0 tokens: 2 s busy
    got = b.update(6.0, {"p1": (900, 600)})  # 600 tokens in 2 s: 4 s / 600
    assert got is not None and abs(got - 600 * 4.0 / 600) < 1e-9


def test_a_decode_forecast_past_the_slo_is_pressure_before_the_gap_crosses_it():
    # A generation-heavy phase building: the mean gap is still under the TPOT SLO (100 ms), but the
    # streams per decode worker grow fast enough that the gap forecast for a stream sent now is past it.
    # The prefill pool is cold (first tokens at 100 ms): it gives the decode pool a worker.
    readings = [
        Reading(
            i * INTERVAL, 2, 1, 100.0, 60.0 + 5.0 * i, running=4 + 3 * i, itl_forecast_ms=120.0 + 10.0 * i
        )
        for i in range(6)
    ]
    decisions, _ = decide_all(readings)
    assert all(d.inputs["itl_forecast_ms"] == r.itl_forecast_ms for d, r in zip(decisions, readings))
    assert actions(decisions) == [(2, "switch_to_decode")]
    # The same gaps without a forecast (the step cost not yet measured): nothing.
    decisions, _ = decide_all(
        [Reading(i * INTERVAL, 2, 1, 100.0, 60.0 + 5.0 * i, running=4 + 3 * i) for i in range(6)]
    )
    assert actions(decisions) == []
    # A forecast over the cold band keeps the decode pool from looking spare: the hot prefill pool gets
    # a new worker instead of one of decode's (its gap now, 20 ms, alone would give one up).
    decisions, _ = decide_all(
        [Reading(i * INTERVAL, 1, 2, 2500.0, 20.0, running=2, itl_forecast_ms=70.0) for i in range(6)]
    )
    assert actions(decisions) == [(2, "add_prefill")]
    decisions, _ = decide_all([Reading(i * INTERVAL, 1, 2, 2500.0, 20.0, running=2) for i in range(6)])
    assert actions(decisions) == [(2, "switch_to_prefill")]


def test_the_decode_forecast_is_the_measured_step_cost_at_the_streams_to_come():
    from pdserve.control.controller import DecodeForecast

    f = DecodeForecast(horizon_s=10.0)
    # Gaps follow 50 ms + 5 ms a stream exactly; streams per worker grow by 1 a second (2 a reading).
    got = [f.update(2.0 * i, 2.0 * i + 1, 50.0 + 5.0 * (2.0 * i + 1)) for i in range(6)]
    assert got[:3] == [None, None, None]  # fewer than 4 readings with a gap
    # From the 4th (streams 1..7: a spread of 6): the step cost at 7 streams + 1/s x 10 s.
    assert got[3] is not None and abs(got[3] - (50.0 + 5.0 * 17)) < 1e-6
    assert got[5] is not None and abs(got[5] - (50.0 + 5.0 * 21)) < 1e-6
    # Streams falling: no growth, the fitted gap at the streams now.
    f.update(12.0, 9.0, 95.0)
    got = f.update(14.0, 7.0, 85.0)
    assert got is not None and abs(got - 85.0) < 1e-6
    # One load level (streams 2-3 throughout): the slope is not measured, no forecast.
    f = DecodeForecast(horizon_s=10.0)
    assert all(f.update(2.0 * i, 2.0 + i % 2, 60.0 + 40.0 * (i % 2)) is None for i in range(10))
    # The load gone (no stream runs): no forecast, however steep the fit kept from the busy phase, so
    # the idle pool reads as cold and a worker added for the load can go again.
    f = DecodeForecast(horizon_s=10.0)
    for i in range(6):
        f.update(2.0 * i, 2.0 * i + 1, 60.0 + 5.0 * (2.0 * i + 1))
    assert f.update(12.0, 0.0, None) is None
    idle = [Reading(i * INTERVAL, 3, 1, itl_forecast_ms=f.update(14.0 + i, 0.0, None)) for i in range(8)]
    assert actions(decide_all(idle)[0]) == [(5, "remove_prefill")]
    # (the fit's gap at one stream, 65 ms of a 100 ms SLO, read as the idle pool's: never cold)
    stale = [Reading(i * INTERVAL, 3, 1, itl_forecast_ms=65.0) for i in range(8)]
    assert actions(decide_all(stale)[0]) == []
    # Gaps that fall as streams rise (noise, other load leaving the CPU) are no step cost.
    f = DecodeForecast(horizon_s=10.0)
    assert all(f.update(2.0 * i, 2.0 * i, 200.0 - 10.0 * i) is None for i in range(8))
