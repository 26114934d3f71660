"""Adaptive drafting (engine/spec_policy.py, engine/row_costs.py): drafts are verified only where
their expected tokens repay the rows they add, by the machine's measured step cost by rows.
- the policy: free rows take every draft worth anything, rows that cost a whole step take none,
  a request's kept drafts are a prefix, more likely drafts go first;
- the costs: interpolation never falls with more rows, the served overhead is learned, the
  calibration is cached per key and read back;
- the engine: greedy output is unchanged with the policy on, and the policy follows the costs it
  is given (no drafts where rows cost as much as a step, drafts where they are free)."""

from __future__ import annotations

import pytest
import torch
from engine_runs import REPEATS, generate

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.row_costs import RowCosts, cache_key, calibration_rows, load_cached, save_cached
from pdserve.engine.spec_policy import acceptance, choose


def flat(r: int) -> float:
    return 1.0


def linear(r: int) -> float:
    return float(r)


def test_free_rows_take_every_draft_worth_anything():
    assert choose(1, [(4, 0.5), (3, 0.9), (2, 0.0)], flat) == [4, 3, 0]


def test_rows_that_cost_a_whole_step_take_none():
    # Each draft row costs what a step of one row costs: at most one token more for a whole row.
    assert choose(1, [(4, 0.99)], linear) == [0]
    assert choose(8, [(4, 0.9)] * 8, linear) == [0] * 8


def test_drafts_fill_the_rows_that_are_cheap():
    def knee(r: int) -> float:  # free up to 4 rows, then a full step's cost per row
        return 1.0 if r <= 4 else float(r - 3)

    assert choose(1, [(4, 1.0)], knee) == [3]
    # Two requests share the three cheap rows: the likelier request's drafts come first.
    assert choose(2, [(4, 0.9), (4, 0.5)], knee) == [2, 0]


def test_kept_drafts_are_a_prefix_and_need_a_clear_gain():
    # 5% more throughput per row is below no gain at a cost 5% higher: the policy stays put.
    assert choose(1, [(4, 0.05)], lambda r: 1.0 + 0.05 * (r - 1)) == [0]
    out = choose(4, [(4, 0.8), (4, 0.6), (4, 0.7), (4, 0.3)], lambda r: 1.0 + 0.1 * r)
    assert out[0] >= out[2] >= out[1] >= out[3] and sum(out) > 0


def test_acceptance_blends_the_request_with_the_prior():
    assert acceptance(0, 0, 0.7) == pytest.approx(0.7)
    assert acceptance(8, 0, 0.5) == pytest.approx(9 / 10)
    assert acceptance(0, 8, 0.5) == pytest.approx(1 / 10)
    assert acceptance(0, 1, 0.1) == pytest.approx(0.2 / 3)


def test_a_low_engine_wide_rate_does_not_keep_new_requests_from_drafting():
    """Earlier traffic whose drafts were rejected leaves a low engine-wide rate; a new request is
    still credited with PROBE until its own first verification, so its drafts are tried at all."""
    prior = acceptance(0, 40, 0.5)
    assert prior < 0.03
    cost = lambda r: 1.0 + 0.1 * (r - 1)  # noqa: E731 - each row a tenth of a step
    assert choose(1, [(4, acceptance(0, 0, prior))], cost)[0] > 0
    assert choose(1, [(4, acceptance(0, 1, prior))], cost) == [0]  # then its own rejection counts


def test_row_costs_interpolate_without_falling_and_learn_the_overhead():
    c = RowCosts([1, 2, 4, 8], [0.010, 0.012, 0.011, 0.020])
    assert c.seconds == [0.010, 0.012, 0.012, 0.020]  # the dip at 4 rows is not believed
    assert c(3) == pytest.approx(0.012)
    assert c(6) == pytest.approx(0.016)
    assert c(16) == pytest.approx(0.036)  # past the last point: its slope
    for _ in range(200):
        c.observe(2, 0.017)  # served steps also schedule and sample
    assert c.overhead == pytest.approx(0.005, rel=1e-3)
    assert c(2) == pytest.approx(0.017, rel=1e-3)


def test_calibration_rows_cover_every_small_count_and_the_cap():
    assert calibration_rows(5) == [1, 2, 3, 4, 5]
    rows = calibration_rows(100)
    assert rows[:8] == list(range(1, 9)) and rows[-1] == 100 and rows == sorted(set(rows))


def test_costs_are_cached_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    a, b = cache_key({"model": "a", "threads": 2}), cache_key({"model": "a", "threads": 1})
    assert a != b
    assert load_cached(a) is None
    save_cached(a, RowCosts([1, 4], [0.01, 0.02]))
    got = load_cached(a)
    assert got is not None and got.rows == [1, 4] and got.seconds == [0.01, 0.02]
    assert load_cached(b) is None
    (tmp_path / "row-costs" / f"{b}.json").write_text("{not json")
    assert load_cached(b) is None  # unreadable: measured again, not a crash


def _engine(spec: str) -> LLMEngine:
    cfg = {
        "model.name": "tiny-llama",
        "cache.device_blocks": 256,
        "cache.block_size": 4,
        "scheduler.speculative_method": spec,
    }
    return LLMEngine(load_config(None, cfg))


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    return generate(engine, REPEATS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


def test_engine_follows_the_costs_and_keeps_greedy_output(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    want = _generate(_engine("none"))
    engine = _engine("ngram")
    assert engine.row_costs is not None  # calibrated at start, and cached
    assert len(list((tmp_path / "row-costs").glob("*.json"))) == 1
    assert engine.pool.num_free == engine.pool.num_blocks  # the calibration's blocks came back
    assert _generate(engine) == want  # whatever the measured costs chose

    engine = _engine("ngram")
    engine.row_costs = RowCosts([1, 64], [1.0, 64.0])  # a row costs a whole step: never worth it
    assert _generate(engine) == want
    assert engine.stats()["spec_draft_tokens_total"] == 0

    engine = _engine("ngram")
    engine.row_costs = RowCosts([1, 64], [1.0, 1.0])  # rows are free: every likely draft runs
    assert _generate(engine) == want
    s = engine.stats()
    assert s["spec_accepted_tokens_total"] > 0 and s["spec_draft_tokens_total"] > 0


def test_a_draft_models_steps_count_against_its_drafts():
    # Free rows, but each level of drafts costs a draft step: only likely drafts repay it.
    assert choose(1, [(4, 0.95)], flat, draft_cost=lambda d: 0.05 * d) == [4]
    assert choose(1, [(4, 0.2)], flat, draft_cost=lambda d: 0.5 * d) == [0]


def test_calibration_keeps_each_counts_fastest_sweep(monkeypatch):
    """A disturbance (another process starting beside the worker) during one run of one row count
    must not set that count's cost, nor, carried upward, every larger count's. A fake model advances a
    fake clock by a millisecond a row, and by 50 ms on two runs of 2 rows in a row."""
    from types import SimpleNamespace

    from pdserve.engine import row_costs

    clock = [0.0]
    runs: dict[int, int] = {}

    class Model:
        arch = SimpleNamespace(sliding_window=None, vocab_size=100)
        device = torch.device("cpu")

        def forward(self, ids, positions, meta, kv_cache, logits_rows):
            n = ids.shape[0]
            runs[n] = runs.get(n, 0) + 1
            clock[0] += 0.050 if (n == 2 and runs[n] in (2, 3)) else 0.001 * n
            return torch.zeros(n, 8)

    class Pool:
        def allocate(self, n):
            return list(range(n))

        def free(self, blocks):
            pass

    monkeypatch.setattr(row_costs.time, "perf_counter", lambda: clock[0])
    costs = row_costs.calibrate(Model(), torch.zeros(1), Pool(), 16, 8, 32)
    assert runs[2] >= 3  # the disturbed run was one of them
    assert costs.seconds == pytest.approx([0.001 * r for r in costs.rows])
