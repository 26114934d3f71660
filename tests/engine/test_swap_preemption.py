"""Preempted requests swap their KV to host RAM and resume from it instead of recomputing."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cache.block_pool import BlockPool
from pdserve.cache.swap import SwapSpace
from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler

BS = 4


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=100))


def _value(rid: str, pos: int) -> float:
    return float(ord(rid[0]) * 1000 + pos)


def _advance(sched: Scheduler, kv: torch.Tensor):
    """One step as the engine does it, writing a value that names (request, position) into each computed slot."""
    step = sched.schedule()
    for req, n in step.scheduled:
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            kv[:, :, req.block_ids[pos // BS] * BS + pos % BS] = _value(req.request_id, pos)
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
    return step


def _kv_of(req: Request, kv: torch.Tensor) -> list[float]:
    return [
        kv[0, 0, req.block_ids[p // BS] * BS + p % BS, 0, 0].item() for p in range(req.num_computed_tokens)
    ]


def _setup(budget_blocks: int, prefix_cache=None):
    kv = torch.zeros(1, 2, 4 * BS, 1, 1)
    pool = BlockPool(4, prefix_cache)
    swap = SwapSpace(kv, BS, budget_blocks * swap_block_bytes(kv))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, watermark_blocks=0), pool, BS, swap=swap)
    return kv, pool, swap, s


def swap_block_bytes(kv: torch.Tensor) -> int:
    return kv[:, :, :BS].numel() * kv.element_size()


def test_preempted_request_swaps_out_and_resumes_with_its_kv():
    kv, pool, swap, s = _setup(budget_blocks=8)
    s.add(_req("a", 7))
    s.add(_req("b", 6))
    _advance(s, kv)  # 2 blocks each: the pool is full
    a, b = s.running
    _advance(s, kv)  # a: 8 tokens, b: 7 (the partial last block)
    step = _advance(s, kv)  # a needs a third block: b (newest) is swapped out
    assert step.preempted == [b] and b.status == RequestStatus.WAITING and b.block_ids == []
    assert b.swapped_tokens == 7 and b.num_computed_tokens == 0 and swap.stats()["swapped_requests"] == 1
    assert swap.used_bytes == 2 * swap.block_bytes
    s.finish(a, "stop")
    step = _advance(s, kv)  # b resumes: one token to compute, not eight
    assert step.scheduled == [(b, 1)] and b.num_computed_tokens == 8
    assert _kv_of(b, kv) == [_value("b", p) for p in range(8)]  # its 7 swapped positions came back
    assert swap.used_bytes == 0 and swap.counters["swapped_in_total"] == 1 and b.recompute_until == 0
    s.finish(b, "stop")
    assert pool.num_free == pool.num_blocks


def test_no_room_in_swap_space_falls_back_to_recompute():
    kv, pool, swap, s = _setup(budget_blocks=1)  # b's two blocks do not fit
    s.add(_req("a", 7))
    s.add(_req("b", 6))
    for _ in range(3):
        step = _advance(s, kv)
    b = step.preempted[0]
    assert b.swapped_tokens == 0 and b.recompute_until == 7 and swap.counters["swap_fallbacks_total"] == 1
    assert swap.used_bytes == 0
    s.finish(s.running[0], "stop")
    step = _advance(s, kv)
    assert step.scheduled == [(b, 8)]  # all 8 tokens computed again, as before


def test_abort_while_swapped_out_frees_the_swap_space():
    kv, pool, swap, s = _setup(budget_blocks=8)
    s.add(_req("a", 7))
    s.add(_req("b", 6))
    for _ in range(3):
        step = _advance(s, kv)
    b = step.preempted[0]
    s.finish(b, "abort")
    assert swap.used_bytes == 0 and swap.counters["swap_discarded_total"] == 1 and b.swapped_tokens == 0
    s.finish(s.running[0], "stop")
    assert pool.num_free == pool.num_blocks and not s.has_unfinished()


# ------------------------------------------------------------------ the engine, greedy parity

QUESTIONS = [
    "What is the capital of Italy?",
    "Name a famous painter.",
    "Why is the sky blue?",
    "Write one sentence about cats.",
    "What is 2 plus 2?",
    "Describe a rainy day.",
]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm_files):
    return [smollm_files.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def unconstrained(smollm_files, prompts):
    # float32 here and in _run: int4 products on an AVX512-BF16 CPU round activations by row count
    # (docs/kernels.md), and preemptions change the rows of a step.
    llm = LLM(model="smollm2-135m", loaded=smollm_files, device_blocks=256, quantization="none")
    outs = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    assert llm.engine.preemptions_total == 0
    return outs


def _run(files, prompts, **overrides):
    # 12 blocks of 16 tokens: the ~40-token prompts are admitted, then outgrow the pool while decoding.
    llm = LLM(model="smollm2-135m", loaded=files, device_blocks=12, quantization="none", **overrides)
    eng = llm.engine
    outs = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    assert eng.pool.num_free == eng.pool.num_blocks
    eng.pool.check_integrity()
    return outs, eng.stats()


@pytest.mark.slow
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_swap_and_recompute_both_match_an_unconstrained_run(
    smollm_files, prompts, unconstrained, prefix_cache
):
    swapped, s = _run(smollm_files, prompts, prefix_cache=prefix_cache)
    recomputed, r = _run(smollm_files, prompts, prefix_cache=prefix_cache, cache__swap_space_gb=0)
    assert swapped == unconstrained and recomputed == unconstrained
    assert s["preemptions_total"] > 0 and r["preemptions_total"] > 0
    assert s["swapped_out_total"] > 0 and s["swapped_in_total"] == s["swapped_out_total"]
    assert s["swap_used_bytes"] == 0 and s["swapped_requests"] == 0
    assert "swapped_out_total" not in r
    assert r["recomputed_tokens_total"] > 0 and s["recomputed_tokens_total"] < r["recomputed_tokens_total"]


def test_abort_of_a_swapped_out_request_in_the_engine():
    llm = LLM(model="tiny-llama", device_blocks=12)
    eng = llm.engine
    for i in range(6):
        p = [(7 * i + 3 * j) % 250 + 1 for j in range(30 + 5 * i)]
        eng.add_request(f"r{i}", p, PARAMS)
    for _ in range(500):
        if any(r.swapped_tokens for r in eng.scheduler.waiting):
            break
        eng.step()
    victim = next(r for r in eng.scheduler.waiting if r.swapped_tokens)
    assert eng.abort_request(victim.request_id).finish_reason == "abort"
    assert eng.swap.stats()["swapped_requests"] == sum(1 for r in eng.scheduler.waiting if r.swapped_tokens)
    assert eng.swap.counters["swap_discarded_total"] == 1
    eng.run_until_idle()
    assert eng.swap.used_bytes == 0 and eng.pool.num_free == eng.pool.num_blocks
    eng.pool.check_integrity()
