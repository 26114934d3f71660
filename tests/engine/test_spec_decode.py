"""Speculative decoding with n-gram drafts (engine/spec_decode.py):
- the proposal: the tokens after the latest earlier match of the last n tokens, or of the last token
  realigned past an edit;
- greedy output is token-identical with and without drafts (accepted and rejected ones, batches,
  a prefix-cache hit after it, a PD decode worker), the KV pool returns to its start, and the
  acceptance counters count;
- sampled output: the first emitted token is distributed as the target's (rejection sampling), and
  so is the bonus token after an accepted draft;
- a constrained request drafts within its grammar and verifies each position under its own mask."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from engine_runs import REPEATS
from engine_runs import generate as _generate
from pd_harness import mixed_outputs, pd_pair, prompts

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.engine.engine import INVARIANT_ROWS, LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.spec_decode import propose, verify
from pdserve.model.kernels import qgemm


def test_propose_takes_what_followed_the_latest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 2, 4) == [7, 5, 1]
    assert propose([1, 2, 3, 4], 3, 2, 4) == []  # no earlier occurrence
    assert propose([4, 5, 6, 4, 5], 5, 2, 4) == [6, 4, 5]  # up to the end of the sequence
    assert propose([1, 2, 3, 1, 2], 0, 2, 4) == []
    # Longer matches first: the last 3 tokens (8, 1, 2) occur once, followed by 9.
    assert propose([8, 1, 2, 9, 0, 1, 2, 5, 8, 1, 2], 1, 2, 3) == [9]


def test_propose_realigns_the_last_token_past_an_edit():
    src = [5, 10, 11, 12, 13, 20, 21, 14, 15, 16, 17, 6]
    # 20 21 replaced by 30: the last two tokens (30, 14) occur nowhere, but 14 follows the pair 12 13
    # in both, 1 token after it in the output and 2 in the source.
    assert propose(src + [10, 11, 12, 13, 30, 14], 3, 2, 4) == [15, 16, 17]
    # 20 21 dropped (nothing in the output between the anchor and 14), and 30 31 32 put in their place.
    assert propose(src + [9, 11, 12, 13, 30, 31, 32, 14], 2, 2, 4) == [15, 16]
    # 30 inserted before 20: the anchor 13 20 is 1 token back in the output and 0 in the source.
    assert propose(src + [12, 13, 20, 30, 21], 2, 2, 4) == [14, 15]
    # A lone token without an anchor pair is not looked up, however often it occurred.
    assert propose([1, 2, 3, 9, 4, 5, 6, 7, 8, 9], 2, 2, 4) == []
    assert propose([1, 9, 2, 9, 3, 9, 4, 5, 6, 9], 2, 2, 4) == []
    # An edit longer than EDIT_GAP tokens is not bridged.
    assert propose(src + [12, 13, 30, 31, 32, 33, 14], 2, 2, 4) == []


def _engine(model: str, spec: str, **more) -> LLMEngine:
    return LLMEngine(
        load_config(
            None,
            {
                "model.name": model,
                "cache.device_blocks": 256,
                "cache.block_size": 4,
                "scheduler.speculative_method": spec,
                # Every proposed draft verified: these tests check the mechanics, not the policy
                # that cuts drafts to what this machine's step costs repay (test_spec_policy.py).
                "scheduler.speculative_adaptive": False,
                **more,
            },
        )
    )


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_greedy_is_token_identical(model):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _generate(_engine(model, "none"), REPEATS, params)
    spec = _engine(model, "ngram")
    assert _generate(spec, REPEATS, params) == want
    assert _generate(spec, REPEATS[:1], params) == {"r0": want["r0"]}  # prefix-cache hit, alone
    s = spec.stats()
    assert s["spec_draft_tokens_total"] > 0
    if model == "tiny-llama":  # it repeats its last token: drafts of that token are accepted
        assert s["spec_accepted_tokens_total"] > 0


def test_greedy_is_token_identical_on_a_real_model_that_quotes_its_prompt():
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
    # float32: int4 products on an AVX512-BF16 CPU round activations by row count (docs/kernels.md),
    # and drafts add rows to a step.
    more = {"cache.device_blocks": 128, "cache.block_size": 16, "model.quantization": "none"}
    off = _engine("smollm2-135m", "none", **more)
    chat = off.tokenizer.encode_chat([{"role": "user", "content": f"Repeat this text exactly:\n{text}"}])
    batch = [chat, off.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = _generate(off, batch, params)
    on = _engine("smollm2-135m", "ngram", **more)
    assert _generate(on, batch, params) == want
    s = on.stats()
    assert 0 < s["spec_accepted_tokens_total"] <= s["spec_draft_tokens_total"]


@pytest.mark.slow
def test_int4_greedy_is_token_identical_and_batch_independent():
    """The default model as its Q4_1 file (int4, its head Q8_0: int8): with model.batch_invariant its
    decode rows take one arithmetic at every row count, so a request's greedy output is the same
    alone and in a batch, and speculative decoding (which turns the same on: a verify step has more
    rows than a plain one) gives those outputs token for token."""
    if not qgemm.available():
        pytest.skip("no C compiler here: the torch path runs")
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
    more = {"cache.device_blocks": 128, "cache.block_size": 16, "model.quantization": "int4"}
    try:
        off = _engine("smollm2-135m", "none", **more, **{"model.batch_invariant": True})
        assert qgemm.invariant_bound() == INVARIANT_ROWS
        tok = off.tokenizer
        batch = [
            tok.encode_chat([{"role": "user", "content": f"Repeat this text exactly:\n{text}"}]),
            tok.encode_chat([{"role": "user", "content": "Name three colours."}]),
            tok.encode_chat([{"role": "user", "content": "What is a prime number?"}]),
            tok.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
            tok.encode_chat([{"role": "user", "content": "Explain what a compiler does."}]),
            tok.encode_chat([{"role": "user", "content": f"Fix the spelling: {text.replace('o', '0')}"}]),
        ]
        # Six streams of 64 tokens: with the row-count paths the drafts' extra rows split a near tie
        # in one of them (found on an Intel Xeon with AMX by running this without the invariance).
        params = SamplingParams(temperature=0, max_tokens=64)
        want = _generate(off, batch, params)
        assert _generate(off, batch[1:2], params) == {"r0": want["r1"]}  # alone: the same tokens
        on = _engine("smollm2-135m", "ngram", **more)
        assert _generate(on, batch, params) == want
        s = on.stats()
        assert 0 < s["spec_accepted_tokens_total"] <= s["spec_draft_tokens_total"]
    finally:
        qgemm.invariant_rows(0)


def test_pd_decode_worker_drafts_and_matches_mixed():
    batch = prompts(3) + REPEATS
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = mixed_outputs(batch, params)
    with pd_pair(
        decode_overrides={"scheduler.speculative_method": "ngram", "scheduler.speculative_adaptive": False}
    ) as (prefill, decode):
        decode.run(batch, params)
        assert {r: decode.outputs[r] for r in want} == want
        decode.wait_idle()
        prefill.wait_idle()
        assert decode.engine.stats()["spec_draft_tokens_total"] > 0


def _req(seed: int, temperature: float = 1.0) -> Request:
    return Request("x", [1, 2, 3], SamplingParams(temperature=temperature, seed=seed))


def _within(counts: dict[int, int], probs: torch.Tensor, n: int) -> None:
    """Empirical frequencies within 5 standard deviations of the target's (float64 arithmetic)."""
    for tok in range(probs.numel()):
        p = float(probs[tok])
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(counts.get(tok, 0) / n - p) <= 5 * sigma + 1e-9, (tok, counts.get(tok, 0) / n, p)


def test_rejection_sampling_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 6, generator=gen, dtype=torch.float64).float() * 1.5
    p0 = rows[0].double().softmax(-1)
    p1 = rows[1].double().softmax(-1)
    draft = int(p0.argsort()[2])  # neither the likeliest nor the rarest token
    n = 6000
    first: dict[int, int] = {}
    bonus: dict[int, int] = {}
    accepted = 0
    for seed in range(n):
        toks, _ = verify(rows, _req(seed), [draft])
        first[toks[0]] = first.get(toks[0], 0) + 1
        if toks[0] == draft:
            assert len(toks) == 2
            accepted += 1
            bonus[toks[1]] = bonus.get(toks[1], 0) + 1
        else:
            assert len(toks) == 1
    _within(first, p0, n)
    _within(bonus, p1, accepted)


def test_greedy_verification_accepts_the_matching_prefix():
    rows = torch.full((4, 5), -1.0)
    for i, best in enumerate([2, 3, 1, 4]):
        rows[i, best] = 1.0
    assert verify(rows, _req(0, 0.0), [2, 3, 0])[0] == [2, 3, 1]  # third draft rejected: argmax 1
    assert verify(rows, _req(0, 0.0), [2, 3, 1])[0] == [2, 3, 1, 4]  # all accepted, plus the bonus
    assert verify(rows, _req(0, 0.0), [0, 3, 1])[0] == [2]


def test_constrained_requests_draft_within_their_grammar():
    from pdserve.bench.json_schemas import schemas
    from pdserve.common.structured import from_request

    cases = schemas(12, seed=5)
    batch = [[1, 504, 3085, 314, 253, 4609, 2397, 30]] * len(cases)

    def run(spec: str, temperature: float) -> tuple[dict, LLMEngine]:
        engine = _engine("tiny-llama", spec)
        for i, s in enumerate(cases):
            c = from_request(structured_outputs={"json": s})
            params = SamplingParams(temperature=temperature, seed=i, max_tokens=300, structured=c.to_wire())
            engine.add_request(f"s{i}", batch[i], params)
        texts: dict[str, str] = {}
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                texts[o.request_id] = texts.get(o.request_id, "") + o.new_text
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                assert not o.finished or o.finish_reason == "stop", (o.request_id, o.error)
        assert engine.pool.num_free == engine.pool.num_blocks
        for i, s in enumerate(cases):
            jsonschema.validate(json.loads(texts[f"s{i}"]), s)
        return tokens, engine

    want, _ = run("none", 0.0)
    got, engine = run("ngram", 0.0)
    assert got == want
    s = engine.stats()
    assert s["spec_accepted_tokens_total"] > 0
    _, engine = run("ngram", 1.0)  # sampled: every output still validates
    assert engine.stats()["spec_draft_tokens_total"] > 0


def test_verification_applies_logit_bias_to_every_row():
    rows = torch.full((3, 5), -1.0)
    rows[:, 2] = 1.0  # 2 is the argmax everywhere; a bias of 5 on token 0 makes 0 the choice
    req = Request("x", [1, 2, 3], SamplingParams(temperature=0.0, logit_bias={0: 5.0}))
    assert verify(rows, req, [0, 0])[0] == [0, 0, 0]
    assert verify(rows, _req(0, 0.0), [0, 0])[0] == [2]


def test_a_prefill_worker_measures_its_row_costs_only_when_it_decodes(monkeypatch):
    """A prefill worker never decodes unless its role switches: it does not time decode steps at start
    (beside the decode worker starting on the same host, each would time the other's work), but on
    its first decode."""
    import pdserve.engine.engine as engine_mod
    from pdserve.engine.row_costs import RowCosts

    calls: list[int] = []
    monkeypatch.setattr(engine_mod, "load_cached", lambda key: None)
    monkeypatch.setattr(engine_mod, "save_cached", lambda key, costs: None)
    monkeypatch.setattr(
        engine_mod, "calibrate", lambda *a, **k: calls.append(1) or RowCosts([1, 2], [0.010, 0.011])
    )
    adaptive = {"scheduler.speculative_adaptive": True}
    e = _engine("tiny-llama", "ngram", **adaptive, **{"worker.role": "prefill"})
    assert calls == [] and e.row_costs is None
    e.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=4, temperature=0.0))
    while e.has_unfinished():
        e.step()
    assert calls == [1] and e.row_costs is not None
    _engine("tiny-llama", "ngram", **adaptive, **{"worker.role": "decode"})
    assert calls == [1, 1]
