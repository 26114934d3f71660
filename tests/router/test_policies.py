"""Routing policies on crafted worker states, a property test over random fleets, and the simulator's
bookkeeping (its KV index must equal the workers' real caches)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.planner.simulate import FleetConfig, TraceConfig, multi_tenant_trace, oracle, policy, simulate
from pdserve.protocol import KV_TIERS
from pdserve.router.policies import (
    POLICIES,
    CostParams,
    RouteRequest,
    WorkerState,
    cache_aware,
    choose,
    cost,
    eligible,
    least_load,
    power_of_two,
    round_robin,
)

BS = 16


def W(wid: str, **kw) -> WorkerState:
    return WorkerState(wid, "mixed", **kw)


def R(n: int = 1024, hits: dict | None = None, max_tokens: int = 64) -> RouteRequest:
    return RouteRequest(n, max_tokens, BS, hits or {})


def run(name: str, req: RouteRequest, workers: list[WorkerState], **kw):
    return choose(name, req, workers, rng=kw.pop("rng", random.Random(0)), **kw)


# ------------------------------------------------------------------ eligibility, round robin


def test_eligible_drops_down_draining_open_and_gated_workers():
    ws = [
        W("ok"),
        W("sick", healthy=False),
        W("drain", draining=True),
        W("open", breaker_open=True),
        W("full", in_flight=8, capacity=8),
        W("kv", kv_usage=0.97),
        W("q", queued_prefill_tokens=500),
    ]
    assert [w.worker_id for w in eligible(ws)] == ["ok", "q"]
    assert [w.worker_id for w in eligible(ws, CostParams(max_queued_prefill_tokens=500))] == ["ok"]


def test_round_robin_cycles_and_skips_ineligible():
    ws = [W("a"), W("b"), W("c")]
    assert [round_robin(R(), ws, i).worker_id for i in range(6)] == ["a", "b", "c", "a", "b", "c"]
    ws[1] = W("b", draining=True)
    assert [round_robin(R(), ws, i).worker_id for i in range(4)] == ["a", "c", "a", "c"]
    ws[0] = W("a", in_flight=64)
    assert {round_robin(R(), ws, i).worker_id for i in range(4)} == {"c"}
    assert round_robin(R(), ws, 0).reason == "round_robin"


# ------------------------------------------------------------------ load policies


def test_least_load_picks_fewest_outstanding_tokens_then_kv():
    ws = [
        W("a", queued_prefill_tokens=900, decode_tokens=200),
        W("b", queued_prefill_tokens=100, decode_tokens=500),
        W("c", queued_prefill_tokens=0, decode_tokens=1000),
    ]
    d = least_load(R(), ws)
    assert d.worker_id == "b" and d.reason == "least_load" and d.scores["a"] == 1100
    tied = [W("a", decode_tokens=10, kv_usage=0.5), W("b", decode_tokens=10, kv_usage=0.2)]
    assert least_load(R(), tied).worker_id == "b"


def test_power_of_two_never_picks_the_heavier_sample():
    ws = [W(f"w{i}", queued_prefill_tokens=100 * i) for i in range(8)]
    for seed in range(200):
        d = power_of_two(R(), ws, random.Random(seed))
        a, b = random.Random(seed).sample(ws, 2)  # the same two samples, replayed
        assert set(d.scores) == {a.worker_id, b.worker_id}
        assert d.worker_id == min(a, b, key=lambda w: w.queued_prefill_tokens).worker_id


def test_power_of_two_is_deterministic_under_a_seed_and_skips_ineligible():
    ws = [W(f"w{i}", decode_tokens=i % 3) for i in range(6)] + [W("sick", healthy=False)]

    def seq(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [power_of_two(R(), ws, rng).worker_id for _ in range(50)]

    assert seq(7) == seq(7)
    assert "sick" not in seq(7) and len(set(seq(7))) > 2
    assert power_of_two(R(), [W("only"), W("x", draining=True)], random.Random(0)).worker_id == "only"


# ------------------------------------------------------------------ cache_aware


def test_cache_aware_follows_the_prefix_unless_its_holder_is_overloaded():
    ws = [W("a", in_flight=3), W("b", in_flight=5), W("c", in_flight=1)]
    hits = {"b": (50, "device"), "a": (25, "device")}
    d = cache_aware(R(1024, hits), ws)
    assert d.worker_id == "b" and d.reason == "cache_hit"
    ws[1] = W("b", in_flight=64)  # its own gate closes
    assert cache_aware(R(1024, hits), ws).worker_id == "a"  # the next holder (400 tokens, 39%)...
    ws[1] = W("b", kv_usage=0.99)
    assert (
        cache_aware(R(1024, hits), ws, CostParams(cache_threshold=0.5)).worker_id == "c"
    )  # ...or least loaded


def test_cache_aware_balances_when_the_fleet_is_skewed():
    ws = [W("a", in_flight=60), W("b", in_flight=2)]
    d = cache_aware(R(1024, {"a": (64, "device")}), ws)
    assert d.worker_id == "b" and d.reason == "balance"
    ws = [W("a", in_flight=20), W("b", in_flight=2)]  # spread below the absolute threshold
    assert cache_aware(R(1024, {"a": (64, "device")}), ws).worker_id == "a"


# ------------------------------------------------------------------ cost


def test_cost_prefers_a_device_hit_over_an_equal_disk_hit():
    ws = [W("disk"), W("dev")]
    d = cost(R(1024, {"disk": (60, "disk"), "dev": (60, "device")}), ws)
    assert d.worker_id == "dev" and d.reason == "cost"
    assert d.scores["dev"] < d.scores["disk"] < cost(R(1024), ws).scores["disk"]  # disk still beats a miss
    host = cost(R(1024, {"host": (60, "host"), "disk": (60, "disk")}), [W("disk"), W("host")])
    assert host.worker_id == "host"


def test_cost_weighs_the_queue_against_the_hit():
    hits = {"cached": (32, "device")}  # 512 cached tokens
    p = CostParams(recompute_weight=1.0, decode_weight=0.0)  # each cached token saves 2 queued tokens
    busy = [W("cached", queued_prefill_tokens=5000), W("idle")]
    assert cost(R(1024, hits), busy, p).worker_id == "idle"
    short = [W("cached", queued_prefill_tokens=500), W("idle")]
    assert cost(R(1024, hits), short, p).worker_id == "cached"
    decode_heavy = [W("cached", decode_tokens=5000), W("idle")]
    assert (
        cost(R(1024, hits), decode_heavy, CostParams(recompute_weight=1.0, decode_weight=1.0)).worker_id
        == "idle"
    )


def test_cost_gates_each_worker_on_its_own():
    hits = {"a": (60, "device"), "b": (50, "device"), "c": (40, "device")}
    ws = [W("a", in_flight=64), W("b", kv_usage=0.96), W("c"), W("d")]
    d = cost(R(1024, hits), ws)
    assert d.worker_id == "c" and set(d.scores) == {"c", "d"}  # the others still serve
    p = CostParams(max_queued_prefill_tokens=1000)
    ws = [W("a", queued_prefill_tokens=1000), W("b", queued_prefill_tokens=999)]
    assert cost(R(1024, hits), ws, p).worker_id == "b"


def test_cost_sends_long_prompts_to_free_kv():
    ws = [
        W("full", kv_usage=0.8, queued_prefill_tokens=0),
        W("free", kv_usage=0.1, queued_prefill_tokens=3000),
    ]
    assert cost(R(8192), ws).worker_id == "free"
    assert cost(R(1024), ws).worker_id == "full"  # below the threshold: the queue decides
    assert cost(R(8192), ws, CostParams(long_prompt_kv_weight=0.0)).worker_id == "full"


def test_cost_ranks_workers_without_room_last():
    ws = [
        W("tight", kv_free_blocks=10, kv_total_blocks=1000),
        W("roomy", kv_free_blocks=900, kv_total_blocks=1000, queued_prefill_tokens=4000),
    ]
    assert cost(R(1024), ws).worker_id == "roomy"  # 68 blocks needed, 10 free
    # resident (device) hits need no new blocks: 60 of the 68 are there
    assert cost(R(1024, {"tight": (60, "device")}), ws).worker_id == "tight"
    ws[1] = W("roomy", kv_free_blocks=5, kv_total_blocks=1000, queued_prefill_tokens=4000)
    assert cost(R(1024), ws).worker_id == "tight"  # nobody has room: cheapest anyway


# ------------------------------------------------------------------ nobody eligible, dispatch


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_says_why_nobody_was_chosen(name):
    down = [W("a", healthy=False), W("b", draining=True), W("c", breaker_open=True)]
    for workers, reason in [
        ([], "no_workers"),
        (down, "no_workers"),
        (down + [W("d", in_flight=64), W("e", kv_usage=1.0)], "overloaded"),
    ]:
        d = run(name, R(1024, {"d": (64, "device")}), workers)
        assert d.worker_id is None and d.reason == reason


def test_choose_rejects_unknown_names_and_power_of_two_without_rng():
    with pytest.raises(ValueError, match="unknown routing policy"):
        choose("random", R(), [W("a")])
    with pytest.raises(ValueError, match="rng"):
        choose("power_of_two", R(), [W("a")])
    assert choose("round_robin", R(), [W("a"), W("b")], counter=3).worker_id == "b"


_workers = st.lists(
    st.builds(
        WorkerState,
        worker_id=st.sampled_from([f"w{i}" for i in range(12)]),
        role=st.just("mixed"),
        healthy=st.booleans(),
        draining=st.booleans(),
        breaker_open=st.booleans(),
        in_flight=st.integers(0, 80),
        queued_prefill_tokens=st.integers(0, 100_000),
        decode_tokens=st.integers(0, 100_000),
        kv_usage=st.floats(0, 1),
        kv_free_blocks=st.integers(0, 5000),
        kv_total_blocks=st.integers(0, 5000),
        capacity=st.integers(1, 80),
    ),
    max_size=12,
)
_hits = st.dictionaries(
    st.sampled_from([f"w{i}" for i in range(14)]),
    st.tuples(st.integers(1, 600), st.sampled_from(KV_TIERS)),
    max_size=14,
)


@settings(max_examples=300, deadline=None)
@given(
    workers=_workers,
    hits=_hits,
    n=st.integers(0, 20_000),
    max_tokens=st.integers(1, 4096),
    name=st.sampled_from(sorted(POLICIES)),
    counter=st.integers(0, 10**6),
    seed=st.integers(0, 2**32),
)
def test_every_decision_names_an_eligible_worker_or_none(workers, hits, n, max_tokens, name, counter, seed):
    d = choose(name, RouteRequest(n, max_tokens, BS, hits), workers, counter=counter, rng=random.Random(seed))
    ok = {w.worker_id for w in eligible(workers)}
    if ok:
        assert d.worker_id in ok
    else:
        assert d.worker_id is None and d.reason in ("overloaded", "no_workers")
    assert set(d.scores) <= ok | set(hits)


# ------------------------------------------------------------------ the simulator


@pytest.mark.parametrize("name", ["cost", "oracle"])
def test_simulator_index_matches_the_real_caches_and_frees_every_block(name):
    trace = multi_tenant_trace(
        TraceConfig(
            num_requests=120,
            num_system_prompts=12,
            rate=0.5,
            long_fraction=0.1,
            long_tokens=(600, 900),
            seed=3,
        )
    )
    fc = FleetConfig(num_workers=3, num_blocks=400)  # small: evictions must happen
    res = simulate(trace, (lambda ws: oracle(ws)) if name == "oracle" else (lambda ws: policy(name)), fc)
    assert 0 < res.hit_rate < 1 and res.load_max_mean >= 1 and res.ttft_p99 >= res.ttft_mean > 0
    assert res.reasons.get(name, 0) == len(trace)
    assert sum(w.evicted for w in res.fleet.values()) > 0
    for wid, w in res.fleet.items():
        assert w.in_flight == 0 and w.queued_est == 0 and abs(w.decode_est) < 1e-6
        w.pool.check_integrity()
        assert w.pool.num_free == fc.num_blocks  # nothing referenced once all finished
        # the router's index, fed only by events, holds exactly what the cache holds
        assert set(res.index.worker_blocks(wid)) == {h.hex() for h in w.cache.nodes}
    assert sum(len(w.cache.nodes) for w in res.fleet.values()) > 0


def test_simulator_trace_hashes_equal_prompt_hashes():
    """The trace hashes only the tail after the system prompt; it must equal hashing it all."""
    from pdserve.cache.prefix_cache import prompt_hashes

    cfg = TraceConfig(
        num_requests=30,
        num_system_prompts=3,
        system_tokens=(20, 70),
        user_tokens=(1, 40),
        block_size=8,
        seed=5,
    )
    trace = multi_tenant_trace(cfg, keep_tokens=True)
    for r in trace:
        assert r.hashes == prompt_hashes(r.tokens, 8, r.salt)
        assert len(r.tokens) == r.num_prompt_tokens
    assert [r.hashes for r in multi_tenant_trace(cfg)] == [r.hashes for r in trace]
