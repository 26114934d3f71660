"""Requests that load their prefix from lower KV tiers: the `loading` state, aborts, deadlines,
block accounting, KV events and the config flags. A tiny model: these are scheduling facts (the
real model's outputs are checked in tests/cache/test_tiers_engine.py)."""

from __future__ import annotations

import argparse
import random
import threading

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cache.kv_events import KVEventSubscriber
from pdserve.cache.prefix_cache import prompt_hashes
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.model.loader import load_model_files
from pdserve.server.roles import build_engine

MODEL = "tiny-llama"
BS = 4
WAIT = 10.0


@pytest.fixture(scope="module")
def loaded():
    return load_model_files(MODEL, 0)


def _config(**cache):
    return load_config(
        None,
        {
            "model.name": MODEL,
            "cache.block_size": BS,
            "cache.device_blocks": 48,
            "cache.host_cache_gb": 0.01,
            "scheduler.max_num_batched_tokens": 32,
            **{f"cache.{k}": v for k, v in cache.items()},
        },
    )


@pytest.fixture
def engines(loaded):
    made: list[LLMEngine] = []

    def make(**cache) -> LLMEngine:
        made.append(LLMEngine(_config(**cache), loaded=loaded))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _params(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _reference(loaded, prompts: dict[str, list[int]], n: dict[str, int]) -> dict[str, list[int]]:
    """Greedy outputs of an engine with no cache at all."""
    llm = LLM(config=load_config(None, {"model.name": MODEL, "cache.prefix_cache": False}), loaded=loaded)
    rids = list(prompts)
    outs = llm.generate([prompts[r] for r in rids], [_params(n[r]) for r in rids])
    return {r: o.token_ids for r, o in zip(rids, outs)}


def _tokens(e: LLMEngine, text: str, n: int) -> list[int]:
    """Exactly n tokens of `text`, repeated as needed."""
    ids = e.tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def _step(e: LLMEngine, outputs: dict[str, list[int]] | None = None) -> None:
    for out in e.step():
        if outputs is not None:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    e.pool.check_integrity()


def _drain(e: LLMEngine, outputs: dict[str, list[int]] | None = None) -> int:
    steps = 0
    while e.has_unfinished():
        _step(e, outputs)
        steps += 1
    return steps


def _warm(e: LLMEngine, ids: list[int]) -> None:
    """Compute `ids` once, then evict every cached block into the host tier."""
    e.add_request("warm", ids, _params(1))
    _drain(e)
    blocks = e.pool.allocate(e.pool.num_free)
    e.pool.free(blocks)
    assert len(e.prefix_cache) == 0 and e.tiers.store.lookup(prompt_hashes(ids, BS)) > 0


def _assert_idle(e: LLMEngine) -> None:
    e.pool.check_integrity()
    assert e.pool.num_free == e.pool.num_blocks
    assert all(e.pool.refcount(b) == 0 for b in range(e.pool.num_blocks))
    assert not e.scheduler.loading and not e.tiers.has_loads() and not e.requests


class Gate:
    """Holds the store's loader thread inside its real fetch until opened: a slow tier on demand."""

    def __init__(self, store) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        real = store._fetch

        def fetch(*args, **kwargs):
            self.entered.set()
            self.open.wait(WAIT)
            return real(*args, **kwargs)

        store._fetch = fetch


def _loader_idle(e: LLMEngine) -> None:
    """The loader is FIFO: once an empty load behind the others reports, every earlier one is over."""
    done = threading.Event()
    e.tiers.store.load_async([], [], e.kv_cache, lambda n: done.set())
    assert done.wait(WAIT)


def test_concurrent_shared_prefix_with_aborts_while_loading_and_running(engines, loaded):
    e = engines()
    tok = e.tokenizer
    prefix = _tokens(e, "a shared system prompt that several users send", 40)  # 10 blocks
    _warm(e, prefix)
    rng = random.Random(3)
    prompts = {f"r{i}": prefix + tok.encode(f" question number {i} about rivers") for i in range(24)}
    n = {r: rng.randint(2, 10) for r in prompts}
    for r, ids in prompts.items():
        e.add_request(r, ids, _params(n[r]))
    outputs: dict[str, list[int]] = {}
    aborted, seen_loading, aborted_loading, steps = set(), [], 0, 0
    while e.has_unfinished():
        for out in e.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        for rid, req in list(e.requests.items()):
            # Every other request seen loading is aborted while its load is in flight (decided once,
            # so how fast the loader thread runs does not change how many are aborted).
            if req.status == RequestStatus.LOADING and rid not in seen_loading:
                seen_loading.append(rid)
                if len(seen_loading) % 2:
                    e.abort_request(rid)
                    aborted.add(rid)
                    aborted_loading += 1
        if steps % 4 == 0 and e.requests:
            rid = rng.choice(sorted(e.requests))
            e.abort_request(rid)
            aborted.add(rid)
        e.pool.check_integrity()
    s = e.stats()
    assert aborted_loading >= 1 and s["tier_fetch_requests_total"] > aborted_loading
    assert s["tier_fetched_tokens_total"] > 0
    _assert_idle(e)
    done = [r for r in prompts if r not in aborted]
    assert len(done) >= 6
    ref = _reference(loaded, {r: prompts[r] for r in done}, n)
    assert {r: outputs[r] for r in done} == ref


def test_abort_while_loading_lets_no_late_write_land_in_freed_blocks(engines, loaded):
    e = engines()
    store = e.tiers.store
    prefix = _tokens(e, "the cancelled load must never write", 32)  # 8 blocks
    _warm(e, prefix)
    gate = Gate(store)
    e.add_request("slow", prefix + [5, 6, 7], _params())
    e.step()
    req = e.requests["slow"]
    assert req.status == RequestStatus.LOADING and gate.entered.wait(WAIT)
    fetched = req.block_ids[req.num_cached_blocks :]
    e.abort_request("slow")  # the loader is inside its first fetch: cancel wins
    assert e.stats()["tier_loads_cancelled_total"] == 1
    _assert_idle(e)
    kv = e.kv_cache
    for b in fetched:  # another request reuses the blocks
        kv[:, :, b * BS : (b + 1) * BS].fill_(-7.0)
    gate.open.set()
    _loader_idle(e)
    for b in fetched:
        assert bool((kv[:, :, b * BS : (b + 1) * BS] == -7.0).all()), f"a write landed in freed block {b}"

    # A load that finished before the abort (cancel answers False): its late result is dropped.
    e.add_request("fast", prefix + [5, 6, 7], _params())
    e.step()
    assert e.requests["fast"].status == RequestStatus.LOADING
    _loader_idle(e)
    e.abort_request("fast")
    assert e.stats()["tier_loads_cancelled_total"] == 1
    e.step()  # drains the stale result
    _assert_idle(e)

    # And the prefix still loads and gives the right answer afterwards.
    out: dict[str, list[int]] = {}
    e.add_request("ok", prefix + [5, 6, 7], _params())
    _drain(e, out)
    assert out["ok"] == _reference(loaded, {"ok": prefix + [5, 6, 7]}, {"ok": 6})["ok"]
    assert e.stats()["tier_fetched_tokens_total"] == 8 * BS
    _assert_idle(e)


def test_load_past_its_deadline_is_cancelled_and_recomputed_without_busy_waiting(engines, loaded):
    e = engines(load_timeout_s=0.3)
    prefix = _tokens(e, "a load that hangs on a slow tier", 32)
    _warm(e, prefix)
    now = [1000.0]
    e.tiers.clock = lambda: now[0]  # the deadline runs on a clock the test moves
    waits: list[float] = []
    real_wait = e.tiers.wait
    e.tiers.wait = lambda timeout: (waits.append(timeout), real_wait(timeout))
    gate = Gate(e.tiers.store)
    try:
        out: dict[str, list[int]] = {}
        e.add_request("r", prefix + [9, 9], _params())
        for _ in range(20):  # before the deadline: still loading, never given up
            _step(e, out)
            assert e.requests["r"].status == RequestStatus.LOADING
        assert e.stats()["tier_fetch_fallbacks_total"] == 0
        # Each step with nothing to compute slept on the loader's event instead of spinning.
        assert len(waits) == 20 and all(t > 0 for t in waits)
        now[0] += 0.3
        _drain(e, out)
        s = e.stats()
        assert s["tier_fetch_fallbacks_total"] == 1 and s["tier_loads_cancelled_total"] == 1
        assert s["prefill_tokens_computed"] >= len(prefix) + 2 + len(prefix)  # warm-up, then all again
        assert out["r"] == _reference(loaded, {"r": prefix + [9, 9]}, {"r": 6})["r"]
        _assert_idle(e)
    finally:
        gate.open.set()


def test_a_tier_hit_longer_than_the_free_pool_is_fetched_in_part(engines, loaded):
    e = engines(device_blocks=44)
    long = _tokens(e, "a long prefix that fills most of the pool", 160)  # 40 blocks
    _warm(e, long)
    prompts = {"busy": _tokens(e, "another user is decoding meanwhile", 24), "long": long + [1, 2, 3]}
    n = {"busy": 12, "long": 4}
    out: dict[str, list[int]] = {}
    e.add_request("busy", prompts["busy"], _params(n["busy"]))
    _step(e, out)
    e.add_request("long", prompts["long"], _params(n["long"]))
    _step(e, out)  # busy's first decode takes its 7th block: 44 - 7 - 1 (watermark) = 36 fit
    assert e.requests["long"].status == RequestStatus.LOADING and "busy" in e.requests  # admitted at once
    assert e.stats()["tier_fetch_blocks_total"] == 36
    _drain(e, out)
    assert e.preemptions_total >= 1  # long's growth preempted busy, which recomputed
    assert out == _reference(loaded, prompts, n)
    _assert_idle(e)


def test_kv_events_report_device_and_host_blocks():
    e = build_engine(_config(kv_events_endpoint="tcp://127.0.0.1:*"))  # a mixed worker's engine
    sub = KVEventSubscriber(e.stats()["kv_events_endpoint"], e.stats()["kv_events_snapshot_endpoint"])
    try:
        ids = _tokens(e, "events for the router's index", 25)
        hashes = {h.hex() for h in prompt_hashes(ids, BS)}
        e.add_request("r", ids, _params(1))
        _drain(e)
        blocks = sub.snapshot().blocks
        assert all(blocks[h] == ["device"] for h in hashes)
        all_blocks = e.pool.allocate(e.pool.num_free)  # evict: device -> host
        e.pool.free(all_blocks)
        blocks = sub.snapshot().blocks
        assert all(blocks[h] == ["host"] for h in hashes)
        assert e.stats()["kv_events_dropped_total"] == 0
    finally:
        sub.close()
        e.close()


def test_cache_tier_flags_reach_the_config():
    from pdserve.cli import _add_engine_flags, _overrides

    p = argparse.ArgumentParser()
    _add_engine_flags(p)
    args = p.parse_args(
        [
            "--host-cache-gb",
            "2",
            "--disk-cache-dir",
            "/tmp/kv",
            "--disk-cache-gb",
            "8",
            "--kv-remote",
            "redis://127.0.0.1:6379/0",
            "--kv-events-endpoint",
            "tcp://*:5557",
        ]
    )
    cc = load_config(None, _overrides(args)).cache
    assert (cc.host_cache_gb, cc.disk_cache_dir, cc.disk_cache_gb, cc.remote, cc.kv_events_endpoint) == (
        2.0,
        "/tmp/kv",
        8.0,
        "redis://127.0.0.1:6379/0",
        "tcp://*:5557",
    )
    assert load_config(None, _overrides(p.parse_args([]))).cache.host_cache_gb == 0.0  # off by default


def test_requests_sharing_a_prefix_in_a_tier_fetch_it_once(engines, loaded):
    e = engines()
    prefix = _tokens(e, "one prefix that two users send at the same moment", 40)  # 10 blocks
    _warm(e, prefix)
    prompts = {"a": prefix + [7, 8, 9], "b": prefix + [9, 8, 7, 6, 5]}
    gate = Gate(e.tiers.store)
    for r, ids in prompts.items():
        e.add_request(r, ids, _params())
    out: dict[str, list[int]] = {}
    _step(e, out)
    # "a" fetches the prefix; "b" needs the same next block and waits for it instead of a second fetch.
    assert e.requests["a"].status == RequestStatus.LOADING
    assert e.requests["b"].status == RequestStatus.WAITING
    gate.open.set()
    _drain(e, out)
    s = e.stats()
    assert s["tier_fetch_requests_total"] == 1 and s["tier_fetched_tokens_total"] == len(prefix)
    assert s["prefill_tokens_computed"] == len(prefix) + 3 + 5  # the warm-up, then each tail once
    assert out == _reference(loaded, prompts, {"a": 6, "b": 6})
    _assert_idle(e)
