"""Hostile sampling values: refused with the parameter named; and a value that gets past the checks
anyway (a bug, a bypass) fails its own request at its step, with its blocks freed, while the engine
and the rest of its batch go on as if it had never been there."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import LLM, SamplingParams
from pdserve.common.errors import InvalidParam
from pdserve.engine.async_engine import AsyncEngine, RequestFailed

NAN, INF = float("nan"), float("inf")
HOSTILE = [
    ({"temperature": 1e-40}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": 0.009}, "temperature"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_p": NAN}, "top_p"),
    ({"min_p": NAN}, "min_p"),
    ({"frequency_penalty": NAN}, "frequency_penalty"),
    ({"presence_penalty": -INF}, "presence_penalty"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["y" * 257]}, "stop"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
]


@pytest.mark.parametrize("fields, param", HOSTILE)
def test_hostile_values_are_refused_naming_the_parameter(fields, param):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**fields).validate()
    assert e.value.param == param


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0},
        {"temperature": 0.01},
        {"temperature": 1e6},
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 100.0},
        {"stop": ["s" * 256] * 16},
        {"stop_token_ids": list(range(256))},
    ],
)
def test_the_limits_themselves_are_accepted(fields):
    SamplingParams(**fields).validate()


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", device_blocks=64, max_num_batched_tokens=64)


class Unchecked(SamplingParams):
    """Values validation refuses, let through: what a bug or a bypass would leave."""

    def validate(self, vocab_size: int | None = None) -> None:
        pass


@pytest.mark.parametrize(
    "field, value", [("temperature", 1e-40), ("temperature", NAN), ("repetition_penalty", 1e-40)]
)
def test_a_request_whose_step_fails_fails_alone(llm, field, value):
    eng = llm.engine
    prompt = llm.tokenizer.encode("one bad request in a batch of good ones")
    good = {
        "greedy": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        "seeded": SamplingParams(temperature=0.8, seed=9, max_tokens=8, ignore_eos=True),
    }
    alone = {rid: llm.generate([prompt], p)[0].token_ids for rid, p in good.items()}
    free = eng.pool.num_free
    for rid, p in good.items():
        eng.add_request(rid, prompt, p)
    eng.add_request(
        "bad",
        prompt,
        Unchecked(**{"temperature": 1.0, "seed": 3, "max_tokens": 8, "ignore_eos": True, field: value}),
    )
    got: dict[str, list[int]] = {}
    ends = {}
    for out in eng.run_until_idle():
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            ends[out.request_id] = (out.finish_reason, out.error)
    assert ends["bad"][0] == "error" and "sampling failed" in ends["bad"][1] and got["bad"] == []
    assert {rid: got[rid] for rid in good} == alone
    assert ends["greedy"] == ends["seeded"] == ("length", None)
    assert eng.pool.num_free == free
    eng.pool.check_integrity()
    assert llm.generate([prompt], good["greedy"])[0].token_ids == alone["greedy"]  # the engine goes on


def test_the_served_engine_stays_alive(llm):
    eng = AsyncEngine(llm.engine)
    eng.start()
    free = llm.engine.pool.num_free
    prompt = llm.tokenizer.encode("serve me after a bad one")

    async def run(rid: str, params: SamplingParams) -> list[int] | str:
        tokens: list[int] = []
        try:
            async for out in eng.generate(rid, prompt, params):
                tokens.extend(out.new_token_ids)
        except RequestFailed as e:
            return str(e)
        return tokens

    async def go() -> tuple:
        bad = Unchecked(temperature=NAN, max_tokens=6, ignore_eos=True)
        good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        first = await asyncio.wait_for(asyncio.gather(run("bad", bad), run("good", good)), 60)
        later = await asyncio.wait_for(run("later", good), 60)
        return first, later

    try:
        (failed, good), later = asyncio.run(go())
        assert isinstance(failed, str) and "sampling failed" in failed
        assert len(good) == 6 and later == good
        assert eng.dead is None
        assert llm.engine.pool.num_free == free
    finally:
        eng.shutdown()


def test_an_error_handling_one_requests_token_fails_that_request_alone(llm):
    # After sampling: its text (a detokenizer that raises stands for any per-request bug there).
    eng = llm.engine
    prompt = llm.tokenizer.encode("text that cannot be made")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    free = eng.pool.num_free
    eng.add_request("good", prompt, params)
    eng.add_request("bad", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))

    def broken(token: int) -> str | None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    eng.detoks["bad"].add = broken
    ends, got = {}, []
    for out in eng.run_until_idle():
        if out.request_id == "good":
            got.extend(out.new_token_ids)
        if out.finished:
            ends[out.request_id] = (out.finish_reason, out.error)
    assert ends["bad"][0] == "error" and "UnicodeDecodeError" in ends["bad"][1]
    assert ends["good"] == ("length", None) and got == alone
    assert eng.pool.num_free == free
    eng.pool.check_integrity()
