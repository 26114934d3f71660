"""Structured outputs in the engine (tiny random model, so only the grammar keeps its output valid):
- 50 schemas of varied shape sampled at temperature 1 in one batch: every output validates;
- requests with different grammars (and none) share steps, and each constrained greedy output is
  the one it gives alone;
- a request resumed with tokens already generated (a PD decode worker after the prefill worker's
  first token, a migrated stream) rebuilds its grammar state and goes on with the same tokens;
- tokens that already left the grammar fail that request alone; the KV pool returns to its start."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve import SamplingParams
from pdserve.bench.json_schemas import schemas
from pdserve.common.structured import Constraint, from_request
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine

MODEL = "tiny-qwen2"
PROMPT = [1, 504, 3085, 314, 253, 4609, 2397, 30]


def _engine() -> LLMEngine:
    return LLMEngine(load_config(None, {"model.name": MODEL, "cache.device_blocks": 256}))


def _run(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams, list[int]]]) -> dict:
    for rid, (prompt, params, given) in reqs.items():
        engine.add_request(rid, prompt, params, output_token_ids=given or None)
    out: dict[str, dict] = {rid: {"tokens": [], "text": "", "reason": None, "error": None} for rid in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            r = out[o.request_id]
            r["tokens"] += o.new_token_ids
            r["text"] += o.new_text
            if o.finished:
                r["reason"], r["error"] = o.finish_reason, o.error
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()
    return out


def _json(schema: dict) -> dict:
    return from_request(structured_outputs={"json": schema}).to_wire()  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def engine():
    return _engine()


def test_fifty_schemas_sampled_all_validate(engine):
    cases = schemas(50)
    reqs = {
        f"s{i}": (PROMPT, SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured=_json(s)), [])
        for i, s in enumerate(cases)
    }
    out = _run(engine, reqs)
    for i, s in enumerate(cases):
        r = out[f"s{i}"]
        assert r["reason"] == "stop", (i, r)
        jsonschema.validate(json.loads(r["text"]), s)


def _mixed_batch() -> dict[str, SamplingParams]:
    def c(**kw) -> dict:
        return from_request(structured_outputs=kw).to_wire()  # type: ignore[union-attr]

    g = {"temperature": 0.0, "max_tokens": 60}
    return {
        "schema": SamplingParams(**g, structured=_json(schemas(1, seed=3)[0])),
        "regex": SamplingParams(**g, structured=c(regex="[0-9]{3}-[a-z]{2,4}")),
        "choice": SamplingParams(**g, structured=c(choice=["alpha", "beta", "gamma"])),
        "grammar": SamplingParams(**g, structured=c(grammar='root ::= "x" [0-9] [0-9]? "y"')),
        "free": SamplingParams(**g),
        "sampled": SamplingParams(temperature=1.0, seed=5, max_tokens=60, structured=_json(schemas(2)[1])),
    }


def test_different_grammars_share_steps_and_match_their_outputs_alone(engine):
    batch = _mixed_batch()
    together = _run(engine, {rid: (PROMPT, p, []) for rid, p in batch.items()})
    for rid, p in batch.items():
        alone = _run(engine, {rid: (PROMPT, p, [])})
        assert alone[rid]["tokens"] == together[rid]["tokens"], rid
    assert together["regex"]["text"][:3].isdigit() and together["regex"]["text"][3] == "-"
    assert together["choice"]["text"] in ("alpha", "beta", "gamma")
    assert together["grammar"]["text"].startswith("x") and together["grammar"]["text"].endswith("y")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resumed_request_rebuilds_its_grammar_and_goes_on(engine, temperature):
    schema = schemas(5, seed=11)[4]
    p = SamplingParams(temperature=temperature, seed=9, max_tokens=200, structured=_json(schema))
    whole = _run(engine, {"w": (PROMPT, p, [])})["w"]
    assert len(whole["tokens"]) > 6
    for k in (1, 5):  # the prefill worker's first token; a stream migrated after k tokens
        rest = _run(engine, {"r": (PROMPT, p, whole["tokens"][:k])})["r"]
        assert whole["tokens"][:k] + rest["tokens"] == whole["tokens"], k
        jsonschema.validate(json.loads(json.dumps(json.loads(whole["text"]))), schema)


def test_tokens_outside_the_grammar_fail_that_request_alone(engine):
    choice = Constraint("choice", json.dumps(["yes", "no"])).to_wire()
    bad = engine.tokenizer.encode("maybe", add_special_tokens=False)
    out = _run(
        engine,
        {
            "bad": (PROMPT, SamplingParams(temperature=0.0, max_tokens=20, structured=choice), bad),
            "good": (PROMPT, SamplingParams(temperature=0.0, max_tokens=20, structured=choice), []),
        },
    )
    assert out["bad"]["reason"] == "error" and "grammar" in out["bad"]["error"]
    assert out["good"]["reason"] == "stop" and out["good"]["text"] in ("yes", "no")
