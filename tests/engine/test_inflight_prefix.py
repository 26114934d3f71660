"""Requests arriving together with a shared prefix compute it once: a waiting request whose next
block a running request is computing waits for the cache instead of computing it again."""

from __future__ import annotations

from dataclasses import replace

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import load_model_files


def _engine(loaded, prefix_cache: bool, budget: int = 256) -> LLMEngine:
    return LLMEngine(
        load_config(
            None,
            {
                "model.name": "tiny-qwen2",
                "cache.block_size": 4,
                "cache.device_blocks": 256,
                "cache.prefix_cache": prefix_cache,
                "scheduler.max_num_batched_tokens": budget,
            },
        ),
        loaded,
    )


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    for o in engine.run_until_idle(lambda _: engine.pool.check_integrity()):
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_simultaneous_requests_compute_a_shared_prefix_once():
    loaded = load_model_files("tiny-qwen2", 0)
    prefix = [(11 * j) % 300 + 5 for j in range(64)]
    prompts = [prefix + [400 + i, 401 + i, 402 + i] for i in range(4)]
    cached = _engine(loaded, True)
    got = _run(cached, prompts)
    assert got == _run(_engine(loaded, False), prompts)
    # One step could take all four prompts; the prefix is computed once, each tail once per request.
    assert cached.prefill_tokens_total <= len(prefix) + 4 * 8
    assert cached.pool.num_free == cached.pool.num_blocks


def test_different_prefixes_are_not_held_back():
    loaded = load_model_files("tiny-qwen2", 0)
    prompts = [[(13 * j + 7 * i) % 300 + 5 for j in range(40)] for i in range(3)]
    cached = _engine(loaded, True, budget=16)
    cached.add_request("a", prompts[0], SamplingParams(max_tokens=1))
    cached.add_request("b", prompts[1], SamplingParams(max_tokens=1))
    step = cached.scheduler.schedule()
    assert [r.request_id for r, _ in step.scheduled] == ["a"]  # the budget (16) goes to the head...
    cached.scheduler.cfg = replace(cached.scheduler.cfg, max_num_batched_tokens=64)
    cached.scheduler.update(step)
    step = cached.scheduler.schedule()
    assert {r.request_id for r, _ in step.scheduled} == {
        "a",
        "b",
    }  # ...and nobody waits on an unrelated prefix
