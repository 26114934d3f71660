"""Speculative decoding with a draft model (engine/draft_model.py): greedy output is the served
model's token for token whatever drafts; the served model drafting for itself has its drafts
accepted; the draft model's KV pool returns to its start; a PD decode worker drafts the same way;
a draft method without a model is a config error naming the key."""

from __future__ import annotations

import pytest
from engine_runs import REPEATS
from engine_runs import generate as _generate
from pd_harness import MODEL, mixed_outputs, pd_pair, prompts

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.config_rules import ConfigError
from pdserve.engine.engine import LLMEngine


def _engine(draft: str | None, adaptive: bool = False, model: str = "tiny-qwen2", **more) -> LLMEngine:
    cfg = {
        "model.name": model,
        "cache.device_blocks": 256,
        "cache.block_size": 4,
        "scheduler.speculative_method": "draft" if draft else "none",
        "scheduler.speculative_model": draft,
        "scheduler.speculative_adaptive": adaptive,
        **more,
    }
    return LLMEngine(load_config(None, cfg))


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_the_served_model_drafting_for_itself_is_accepted():
    want = _generate(_engine(None), REPEATS, GREEDY)
    engine = _engine("tiny-qwen2")  # its greedy tokens depend on its KV: a stale draft KV shows
    assert _generate(engine, REPEATS, GREEDY) == want
    s = engine.stats()
    # Its greedy drafts are the served model's own tokens: rejected only where float rounding of a
    # prefill row against a decode row splits a near tie.
    assert s["spec_draft_tokens_total"] > 0
    assert s["spec_accepted_tokens_total"] >= 0.8 * s["spec_draft_tokens_total"]


@pytest.mark.parametrize("adaptive", [False, True])
def test_another_draft_model_keeps_greedy_output(adaptive):
    want = _generate(_engine(None), REPEATS, GREEDY)
    engine = _engine("tiny-mistral", adaptive)
    assert _generate(engine, REPEATS, GREEDY) == want
    assert _generate(engine, REPEATS[:1], GREEDY) == {"r0": want["r0"]}  # a prefix-cache hit, alone
    if not adaptive:
        assert engine.stats()["spec_draft_tokens_total"] > 0


def test_sampled_output_with_a_draft_model_finishes_and_frees():
    engine = _engine("tiny-mistral")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    out = _generate(engine, REPEATS, params)
    assert all(len(v) == 30 for v in out.values())


def test_pd_decode_worker_drafts_with_a_model_and_matches_mixed():
    batch = prompts(3) + REPEATS
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = mixed_outputs(batch, params)
    overrides = {
        "scheduler.speculative_method": "draft",
        "scheduler.speculative_model": MODEL,
        "scheduler.speculative_adaptive": False,
    }
    with pd_pair(decode_overrides=overrides) as (prefill, decode):
        decode.run(batch, params)
        assert {r: decode.outputs[r] for r in want} == want
        decode.wait_idle()
        prefill.wait_idle()
        assert decode.engine.stats()["spec_accepted_tokens_total"] > 0


def test_a_draft_method_needs_a_model():
    with pytest.raises(ConfigError, match="scheduler.speculative_model"):
        load_config(None, {"scheduler.speculative_method": "draft"})


@pytest.mark.slow
def test_int4_smollm2_drafts_for_its_float32_self():
    more = {"cache.device_blocks": 128, "cache.block_size": 16, "model.quantization": "none"}
    off = _engine(None, model="smollm2-135m", **more)
    chat = off.tokenizer.encode_chat([{"role": "user", "content": "Explain what a compiler does."}])
    params = SamplingParams(temperature=0, max_tokens=48)
    want = _generate(off, [chat], params)
    on = _engine("smollm2-135m", model="smollm2-135m", **more)  # speculative_quantization auto: int4
    assert _generate(on, [chat], params) == want
    s = on.stats()
    # int4 agrees with float32 on most greedy tokens (benchmarks/quant_quality.py).
    assert s["spec_accepted_tokens_total"] >= 0.5 * s["spec_draft_tokens_total"] > 0


def test_catch_up_runs_within_the_step_token_budget():
    budget = 8  # below every REPEATS prompt: each new request's catch-up takes several forwards
    want = _generate(_engine(None, **{"scheduler.max_num_batched_tokens": budget}), REPEATS, GREEDY)
    engine = _engine("tiny-mistral", **{"scheduler.max_num_batched_tokens": budget})
    drafter = engine.drafter
    assert drafter is not None
    rows: list[int] = []
    forward = drafter.model.forward

    def counted(input_ids, *args, **kwargs):  # the real forward, its row count noted
        rows.append(int(input_ids.shape[0]))
        return forward(input_ids, *args, **kwargs)

    drafter.model.forward = counted
    assert _generate(engine, REPEATS, GREEDY) == want
    assert rows and max(rows) <= budget
    assert sum(rows) >= sum(len(p) for p in REPEATS)  # every prompt token was caught up
    assert engine.stats()["spec_accepted_tokens_total"] > 0


def test_draft_state_is_freed_when_a_request_ends_between_steps():
    engine = _engine("tiny-mistral")
    drafter = engine.drafter
    assert drafter is not None
    for i, p in enumerate(REPEATS):
        engine.add_request(f"r{i}", p, GREEDY)
    while len(drafter.seqs) < len(REPEATS):  # every request has drafted at least once
        engine.step()
    engine.abort_request("r1")
    assert "r1" not in drafter.seqs  # at once, not at the next step
    held = sum(len(s.blocks) for s in drafter.seqs.values())
    assert drafter.pool.num_free == drafter.pool.num_blocks - held
    for rid in ("r0", "r2"):
        engine.abort_request(rid)
    assert not engine.has_unfinished()  # no step follows: the aborts alone freed the draft pool
    assert not drafter.seqs and drafter.pool.num_free == drafter.pool.num_blocks
