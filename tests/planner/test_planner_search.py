"""The planner on a synthetic profile: the cost model, the PD simulator against hand-computed
timelines, the search's choices as the workload shifts, and the profile file's round trip."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve.planner.pd_simulate import PDFleet, PDRequest, RoleSettings, simulate_pd
from pdserve.planner.search import SearchSpace, plan, predict, served, text_tokens, workload_requests
from pdserve.planner.step_costs import FORMAT, Grid, ProfileError, Serving, StepCosts


def synthetic(**kw) -> StepCosts:
    """Prefill 2 ms + 1 ms a token (+ 1 us per token of context); decode 20 ms + 1 ms a sequence
    (+ 10 us per sequence per 1k context); KV moves at 1 GB/s after 1 ms."""
    chunks, pctx = [16, 64, 256, 1024], [0, 1024, 4096]
    batches, dctx = [1, 8, 32, 128], [0, 1024, 4096]
    costs = StepCosts(
        cpu="synthetic",
        cores=64,
        model="synthetic",
        dtype="float32",
        quantization="none",
        threads=1,
        block_size=16,
        num_layers=10,
        kv_bytes_per_token=1000,
        prefill=Grid(chunks, pctx, [[0.002 + 0.001 * t + 1e-6 * t * c / 1024 for c in pctx] for t in chunks]),
        decode=Grid(
            batches, dctx, [[0.020 + 0.001 * b + 1e-5 * b * c / 1024 for c in dctx] for b in batches]
        ),
        transport="shm",
        transfer_bytes=[10_000, 1_000_000],
        transfer_seconds=[0.001 + 1e-5, 0.001 + 1e-3],
    )
    return replace(costs, **kw)


def test_grid_interpolates_between_and_extrapolates_beyond_its_points():
    g = Grid([1, 3], [0, 10], [[1.0, 2.0], [3.0, 4.0]])
    assert g.at(1, 0) == 1.0 and g.at(3, 10) == 4.0
    assert g.at(2, 5) == pytest.approx(2.5)
    assert g.at(5, 0) == pytest.approx(5.0)  # the last two rows' slope, carried on
    assert g.at(-100, 0) == pytest.approx(0.1)  # never below a tenth of the fastest step


def test_cost_model_reads_the_grids_and_the_transfer_line():
    c = synthetic()
    assert c.prefill_s(64, 0) == pytest.approx(0.066)
    assert c.decode_s(8, 0) == pytest.approx(0.028)
    assert c.transfer_s(500_000) == pytest.approx(0.0015)
    assert c.exposed_transfer_s(1000) == pytest.approx(c.transfer_s(1_000_000) / 10)  # layer by layer
    assert replace(c, layerwise=False).exposed_transfer_s(1000) == pytest.approx(c.transfer_s(1_000_000))
    # A mixed step: the linear layers over every token, the decoders' attention on top.
    assert c.step_s(8, 1024, 64, 0) == pytest.approx(c.prefill_s(72, 0) + 8 * 1e-5)


SERVING = Serving(
    pd_local_overhead_s=0.05,
    pd_remote_overhead_s=0.1,
    pd_step_s=0.01,
    mixed_overhead_s=0.03,
    mixed_step_s=0.005,
)


def test_served_fleets_carry_the_measured_overheads_of_their_kind():
    c = synthetic(serving=SERVING)
    pd = served(PDFleet(), c)
    assert (pd.overhead_s, pd.remote_overhead_s, pd.step_overhead_s) == (0.05, 0.1, 0.01)
    mixed = served(PDFleet(mixed=1), c)
    assert (mixed.overhead_s, mixed.step_overhead_s) == (0.03, 0.005)
    assert served(PDFleet(), synthetic()) == PDFleet()
    reqs = workload_requests("fixed", 10, 0.2, input_len=100, max_tokens=10)
    assert predict(c, PDFleet(), reqs).ttft_p50_s > predict(synthetic(), PDFleet(), reqs).ttft_p50_s + 0.09


def test_profile_file_round_trip_and_bad_files(tmp_path):
    c = synthetic(notes={"role": "decode"}, serving=SERVING)
    path = tmp_path / "p.json"
    c.save(path)
    assert StepCosts.load(path) == c
    data = json.loads(path.read_text())
    for bad, needle in (
        (dict(data, format="other"), "format"),
        (dict(data, extra=1), "unknown keys"),
        (dict(data, decode={**data["decode"], "seconds": [[0.0] * 3] * 4}), "positive"),
        (dict(data, cores=0), "cores"),
        ({k: v for k, v in data.items() if k != "model"}, "model"),
        (dict(data, serving={"pd_step_s": 1}), "malformed"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=needle):
            StepCosts.load(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        StepCosts.load(path)
    with pytest.raises(ProfileError, match="cannot read"):
        StepCosts.load(tmp_path / "missing.json")
    assert FORMAT in c.to_json()


def test_one_request_through_1p1d_follows_the_hand_computed_timeline():
    c = synthetic()
    fleet = PDFleet(
        prefill=1,
        decode=1,
        prefill_settings=RoleSettings(64, 64),
        overhead_s=0.003,
        remote_overhead_s=0.005,
        step_overhead_s=0.002,
    )
    [r] = simulate_pd([PDRequest(0, 1.0, 100, 4)], fleet, c)
    # Chunks of 64 then 36 on the prefill worker and the exposed transfer; the idle decode worker takes
    # the request in and decodes its second token (context 101) before the step's outputs, the first
    # token among them, go out; the third and fourth tokens take a step each at context 102 and 103.
    kv_in = 1.0 + c.prefill_s(64, 0) + c.prefill_s(36, 64) + 2 * 0.002 + c.exposed_transfer_s(100)
    first = kv_in + c.decode_s(1, 101) + 0.002
    assert r.first_token == pytest.approx(first + 0.005)
    steps = sum(c.decode_s(1, n) + 0.002 for n in (102, 103))
    assert r.finish == pytest.approx(first + steps + 0.005)
    assert r.tpot == pytest.approx(steps / 3)  # the first two tokens come out together


def test_a_loaded_request_shows_its_first_token_when_the_decode_step_it_joins_ends():
    # A local request decodes on the decode worker when a remote one's KV arrives mid-step: the remote
    # one joins the next step, and its first token goes out with that step's outputs at its end.
    c = synthetic()
    fleet = PDFleet(prefill=1, decode=1, prefill_settings=RoleSettings(64, 512), local_prefill_max_tokens=64)
    local, remote = simulate_pd([PDRequest(0, 0.0, 20, 40), PDRequest(1, 0.0, 100, 3)], fleet, c)
    assert remote.remote and not local.remote
    kv_in = local.first_token + c.prefill_s(100, 0) + c.exposed_transfer_s(100)
    # the decode worker's step boundaries after the local prompt: a decode step each (context 21 + k)
    joined, k = local.first_token, 0
    while joined < kv_in:
        joined += c.decode_s(1, 21 + k)
        k += 1
    assert remote.first_token == pytest.approx(joined + c.decode_s(2, round((21 + k + 101) / 2)))
    # a request of one token ends on arrival of its KV: with nothing else to run it goes out at once
    [one] = simulate_pd([PDRequest(0, 0.0, 100, 1)], fleet, c)
    assert (
        one.first_token == pytest.approx(c.prefill_s(100, 0) + c.exposed_transfer_s(100))
        and one.finish == one.first_token
    )


def test_short_prompts_are_prefilled_by_the_decode_worker_and_mixed_steps_share_the_forward():
    c = synthetic()
    fleet = PDFleet(prefill=1, decode=1, local_prefill_max_tokens=64)
    [r] = simulate_pd([PDRequest(0, 0.0, 20, 2)], fleet, c)
    assert not r.remote and r.first_token == pytest.approx(c.prefill_s(20, 0))
    # Two requests on one mixed worker: the second's prompt runs in the first's decode step.
    a, b = simulate_pd([PDRequest(0, 0.0, 20, 3), PDRequest(1, 0.01, 20, 2)], PDFleet(mixed=1), c)
    t1 = c.prefill_s(20, 0)
    assert b.first_token == pytest.approx(t1 + c.step_s(1, 21, 20, 0))


def test_a_loaded_worker_queues_and_the_router_spreads_over_the_pool():
    c = synthetic()
    reqs = [PDRequest(i, 0.0, 500, 2) for i in range(4)]
    one = simulate_pd(reqs, PDFleet(prefill=1, decode=1, prefill_settings=RoleSettings(64, 512)), c)
    two = simulate_pd(reqs, PDFleet(prefill=2, decode=1, prefill_settings=RoleSettings(64, 512)), c)
    assert max(r.ttft for r in two) < 0.7 * max(r.ttft for r in one)


def _best(workload: str, rate: float, **kw):
    reqs = workload_requests("fixed", 60, rate, seed=1, **kw)
    assert workload
    return plan(
        synthetic(cores=64),
        PDFleet(),
        reqs,
        slo_ttft_s=1.5,
        slo_tpot_s=0.06,
        space=SearchSpace(4, prefill_chunks=(256, 1024), decode_max_num_seqs=(64,), mixed=False),
    )


def test_prompt_heavy_work_gets_more_prefill_workers_than_generation_heavy_work():
    prompt_heavy = _best("prompt", 2.0, input_len=900, max_tokens=4).best.fleet
    gen_heavy = _best("gen", 2.0, input_len=80, max_tokens=200).best.fleet
    assert prompt_heavy.prefill > gen_heavy.prefill
    assert prompt_heavy.prefill >= prompt_heavy.decode and gen_heavy.decode > gen_heavy.prefill


def test_an_slo_no_deployment_meets_is_reported_infeasible():
    reqs = workload_requests("fixed", 30, 1.0, input_len=500, max_tokens=8)
    result = plan(synthetic(), PDFleet(), reqs, slo_ttft_s=0.01, slo_tpot_s=0.06, space=SearchSpace(3))
    assert not result.feasible and result.best.attained < 0.9
    ok = plan(synthetic(), PDFleet(), reqs, slo_ttft_s=5.0, slo_tpot_s=1.0, space=SearchSpace(3))
    assert ok.feasible and ok.best.attained == 1.0


def test_predict_reports_percentiles_of_the_simulated_requests():
    reqs = workload_requests("fixed", 20, 0.5, input_len=100, max_tokens=10)
    p = predict(synthetic(), PDFleet(), reqs)
    # the first token comes out with the second, then eight steps of ~21 ms: TPOT 8 x 21 / 9 ms
    assert 0 < p.ttft_p50_s <= p.ttft_p90_s and 0.015 < p.tpot_p50_s < 0.05 and p.attained == 1.0


def test_workload_tokens_follow_the_word_list_rule():
    assert text_tokens("one two three") == 3 and text_tokens("One two. Three four.") == 6
    reqs = workload_requests("fixed", 5, 1.0, input_len=77, max_tokens=9)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(77, 9)] * 5
    assert reqs[0].arrival == 0.0 and all(a.arrival < b.arrival for a, b in zip(reqs, reqs[1:]))


def test_a_decode_step_with_every_other_worker_idle_borrows_their_cores():
    """A PD decode step that starts while no other worker computes on the shared machine takes the
    lent factor; while the prefill worker computes a long prompt it does not; on machines of their
    own (cores None) there is nothing to borrow."""
    fleet = PDFleet(
        1,
        1,
        prefill_settings=RoleSettings(64, 512),
        decode_settings=RoleSettings(64, 512),
        threads=1,
        cores=2,
    )
    lent = replace(fleet, decode_lent=0.5)

    def tpot(f: PDFleet, reqs: list[PDRequest]) -> float:
        return next(r.tpot for r in simulate_pd(reqs, f, synthetic()) if r.rid == 0)

    alone = [PDRequest(0, 0.0, 40, 20)]
    assert tpot(lent, alone) == pytest.approx(0.5 * tpot(fleet, alone))
    # A 4,000-token prompt on the prefill worker meanwhile: some steps run beside it, unlent.
    busy = [PDRequest(0, 0.0, 40, 20), PDRequest(1, 0.0, 4000, 1)]
    assert 0.5 * tpot(fleet, busy) < tpot(lent, busy) < tpot(fleet, busy)
    apart = replace(fleet, cores=None)
    assert tpot(replace(apart, decode_lent=0.5), alone) == pytest.approx(tpot(apart, alone))


def test_a_prompt_step_with_every_other_worker_idle_borrows_their_cores():
    """A PD prefill worker's step (and a decode worker's local prompt) that starts while no other
    worker computes takes the prefill lent factor; the decode steps keep theirs; a mixed server has
    no peer to borrow from."""
    fleet = PDFleet(
        1,
        1,
        prefill_settings=RoleSettings(64, 512),
        decode_settings=RoleSettings(64, 512),
        threads=1,
        cores=2,
    )
    remote = [PDRequest(0, 0.0, 1000, 1)]  # past local_prefill_max_tokens: the prefill worker's
    local = [PDRequest(0, 0.0, 40, 1)]

    def ttft(f: PDFleet, reqs: list[PDRequest]) -> float:
        return next(r.ttft for r in simulate_pd(reqs, f, synthetic()))

    for reqs in (remote, local):
        assert ttft(replace(fleet, prefill_lent=0.5), reqs) < ttft(fleet, reqs)
        assert ttft(replace(fleet, decode_lent=0.5), reqs) == pytest.approx(ttft(fleet, reqs))
    mixed = PDFleet(0, 0, mixed=1, decode_settings=RoleSettings(64, 512), threads=1, cores=2)
    assert ttft(mixed, local) == pytest.approx(ttft(replace(mixed, prefill_lent=0.5), local))


def test_a_step_beside_a_busy_worker_runs_at_the_measured_contended_speed():
    # A local 20-token request decodes while a prefill worker computes a long prompt beside it.
    reqs = [PDRequest(0, 0.0, 20, 6), PDRequest(1, 0.0, 2000, 2)]
    fleet = PDFleet(prefill=1, decode=1, prefill_settings=RoleSettings(64, 512))
    alone = simulate_pd(reqs, fleet, synthetic())
    slow = simulate_pd(reqs, fleet, synthetic(contended_decode=2.0, contended_prefill=1.5))
    # Of its five decode steps the first starts before the prefill worker has its job (sent at that
    # step's boundary); the other four run beside it at twice the time.
    assert slow[0].tpot == pytest.approx(alone[0].tpot * (1 + 4 * 2) / 5, rel=0.01)
    # the prefill worker's first chunk starts beside the decode worker's second step
    assert slow[1].ttft > 1.05 * alone[1].ttft
    with pytest.raises(ProfileError, match="contended"):
        StepCosts.from_dict(json.loads(synthetic(contended_decode=0.5).to_json()))


def test_the_served_calibration_prompt_is_a_profiled_row_and_its_overhead_leaves_out_the_steps():
    from pdserve.planner.serving import overheads, remote_prompt_tokens

    c = synthetic()  # prefill rows 16, 64, 256, 1024
    assert remote_prompt_tokens(c, 64, 512) == 256  # the shortest row a prefill worker takes in one step
    assert remote_prompt_tokens(c, 32, 512) == 64
    assert remote_prompt_tokens(c, 300, 512) == 316  # no row fits: a prompt past the local limit
    # Served medians = the profiled steps + 3 ms a step + 40 ms a request: the overheads come back out.
    decode_1 = sum(c.decode_s(1, 32 + i) for i in range(1, 48)) / 47
    step = 0.003
    pd = {
        "tpot": decode_1 + step,
        "short": c.prefill_s(32, 0) + step + 0.04,
        "long": c.prefill_s(256, 0) + step + c.exposed_transfer_s(256) + c.decode_s(1, 256) + step + 0.04,
    }
    s = overheads(c, pd, {"tpot": decode_1, "short": c.prefill_s(32, 0) + 0.01}, 32, 256, 512)
    assert s.pd_step_s == pytest.approx(step) and s.mixed_step_s == pytest.approx(0.0, abs=1e-12)
    assert s.pd_local_overhead_s == pytest.approx(0.04) and s.mixed_overhead_s == pytest.approx(0.01)
    # The decode step the loaded request joins is the simulator's, not part of the overhead.
    assert s.pd_remote_overhead_s == pytest.approx(0.04)


def test_the_overheads_leave_out_the_served_steps_where_the_workers_report_them():
    """The served steps, not the profile's, come off: a machine running 20% slower than at profile
    time leaves the same overheads."""
    from pdserve.planner.serving import overheads

    c = synthetic()
    slow = 1.2
    dec, pre, long_pre = c.decode_s(1, 40) * slow, c.prefill_s(32, 0) * slow, c.prefill_s(256, 0) * slow
    step = 0.002
    pd = {
        "tpot": dec + step,
        "decode_step": dec,
        "short": pre + step + 0.03,
        "short_prefill": pre,
        "long": long_pre + step + c.exposed_transfer_s(256) + dec + step + 0.05,
        "long_prefill": long_pre,
        "long_decode_step": dec,
    }
    mixed = {"tpot": dec + 0.001, "decode_step": dec, "short": pre + 0.001 + 0.02, "short_prefill": pre}
    s = overheads(c, pd, mixed, 32, 256, 512)
    assert s.pd_step_s == pytest.approx(step) and s.mixed_step_s == pytest.approx(0.001)
    assert s.pd_local_overhead_s == pytest.approx(0.03) and s.mixed_overhead_s == pytest.approx(0.02)
    assert s.pd_remote_overhead_s == pytest.approx(0.05)
    # Against the profile's steps the drift reads as overhead (the old calibration).
    profiled = overheads(
        c,
        {k: pd[k] for k in ("tpot", "short", "long")},
        {k: mixed[k] for k in ("tpot", "short")},
        32,
        256,
        512,
    )
    assert profiled.pd_step_s > step + 0.1 * dec and profiled.pd_remote_overhead_s > 0.05 + 0.1 * long_pre


def test_a_worker_reports_its_served_step_times():
    """The engine counts and times its decode and prefill steps, /metrics exports them, and the
    calibration's parser reads them back."""
    from pdserve import SamplingParams
    from pdserve.config import load_config
    from pdserve.engine.engine import LLMEngine
    from pdserve.planner.serving import parse_step_counters
    from pdserve.server.metrics import ServerMetrics

    engine = LLMEngine(load_config(None, {"model.name": "tiny-qwen2", "cache.block_size": 4}))
    try:
        metrics = ServerMetrics(engine.stats)
        assert parse_step_counters(metrics.render().decode()) == {
            "decode_steps": 0,
            "decode_step_seconds": 0,
            "prefill_steps": 0,
            "prefill_step_seconds": 0,
        }
        engine.add_request(
            "r", list(range(5, 40)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
        list(engine.run_until_idle())
        got = parse_step_counters(metrics.render().decode())
        assert got is not None and got["prefill_steps"] == 1 and got["decode_steps"] == 5
        assert got["prefill_step_seconds"] > 0 and got["decode_step_seconds"] > 0
    finally:
        engine.close()


def test_the_profiles_grids_scale_to_the_served_steps():
    """Served steps 20% slower than profiled (decode) and 10% faster (prefill) give those factors;
    without served steps both stay 1; a scaled grid interpolates the scaled times."""
    from pdserve.planner.serving import REPLY, served_scales

    c = synthetic()
    decode_1 = sum(c.decode_s(1, 32 + i) for i in range(1, REPLY)) / (REPLY - 1)
    pd = {
        "decode_step": 1.2 * decode_1,
        "short_prefill": 0.9 * c.prefill_s(32, 0),
        "long_prefill": 0.9 * c.prefill_s(256, 0),
    }
    mixed = {"decode_step": 1.2 * decode_1, "short_prefill": 0.9 * c.prefill_s(32, 0)}
    assert served_scales(c, pd, mixed, 32, 256) == (
        pytest.approx(1.2),
        pytest.approx(0.9),
        pytest.approx(1.0),
        pytest.approx(1.0),
    )
    assert served_scales(c, {"tpot": 0.03}, {"tpot": 0.03}, 32, 256) == (1.0, 1.0, 1.0, 1.0)
    # PD steps borrowing the idle peer's cores: the grids take the mixed server's scales, the PD
    # workers' ratios to them are the lent factors (prefill: both of its steps, geometric mean).
    lent = dict(
        pd,
        decode_step=0.6 * decode_1,
        short_prefill=0.72 * c.prefill_s(32, 0),
        long_prefill=0.5 * c.prefill_s(256, 0),
    )
    assert served_scales(c, lent, mixed, 32, 256) == (
        pytest.approx(1.2),
        pytest.approx(0.9),
        pytest.approx(0.5),
        pytest.approx(0.6 / 0.9),
    )
    # Without the mixed server's prefill the PD workers' is the scale, and nothing is lent.
    assert served_scales(c, lent, {"decode_step": 1.2 * decode_1}, 32, 256)[1:] == (
        pytest.approx(0.6),
        pytest.approx(0.5),
        pytest.approx(1.0),
    )
    g = c.decode.scaled(1.2)
    assert g.at(3, 100) == pytest.approx(1.2 * c.decode.at(3, 100)) and c.decode.scaled(1.0) == c.decode
