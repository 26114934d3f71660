"""Engine behaviour on a tiny random model: fast paths of the offline API."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.common.errors import InvalidParam


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", device_blocks=64, max_num_batched_tokens=64)


def test_generate_accepts_text_and_token_ids(llm):
    a = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=5))[0]
    b = llm.generate([llm.tokenizer.encode("hello world")], SamplingParams(temperature=0, max_tokens=5))[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 5 and a.finish_reason == "length"
    assert a.text == llm.tokenizer.decode(a.token_ids)


def test_token_ids_only_skips_the_text_not_the_tokens(llm):
    # What a worker behind the router runs: the router detokenizes, the worker does not.
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = llm.generate("hello world", p)[0]
    ids = llm.generate("hello world", SamplingParams(**{**p.__dict__, "detokenize": False}))[0]
    assert ids.token_ids == text.token_ids and ids.text == "" and text.text
    with pytest.raises(InvalidParam):
        llm.engine.check_request([1, 2], SamplingParams(stop=["x"], detokenize=False))


def test_stop_token_ids_and_eos(llm):
    first = llm.generate("abc", SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first[2]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(first[2]) + 1]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=8)
    alone = llm.generate("seeded", p)[0].token_ids
    batch = llm.generate(
        ["other prompt", "seeded", "third"],
        [SamplingParams(temperature=0.8, max_tokens=8), p, SamplingParams(temperature=0, max_tokens=8)],
    )
    assert batch[1].token_ids == alone


def test_a_request_resumed_from_its_outputs_continues_exactly(llm):
    # What a migrated stream does: the new worker gets the prompt plus the tokens generated so far
    # as output; seeded draws, penalties and max_tokens carry on as if nothing had happened.
    eng = llm.engine
    prompt = llm.tokenizer.encode("resume me somewhere else")
    for p in (
        SamplingParams(
            temperature=0.9,
            top_p=0.95,
            seed=5,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            max_tokens=12,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
    ):
        full = llm.generate([prompt], p)[0].token_ids
        assert len(full) == 12
        free = eng.pool.num_free
        eng.add_request("resumed", prompt, p, output_token_ids=full[:5])
        rest: list[int] = []
        for out in eng.run_until_idle():
            rest.extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == "length" and out.num_output_tokens == 12
        assert rest == full[5:] and eng.pool.num_free == free
    with pytest.raises(InvalidParam):  # nothing left to generate
        eng.add_request("over", prompt, SamplingParams(max_tokens=3), output_token_ids=[5, 6, 7])


def test_rejects_impossible_requests_without_allocating(llm):
    free = llm.engine.pool.num_free
    with pytest.raises(InvalidParam):
        llm.generate("x", SamplingParams(max_tokens=10_000))
    with pytest.raises(InvalidParam):  # more KV than the whole pool (64 blocks x 16 tokens)
        llm.generate("x", SamplingParams(max_tokens=1500))
    with pytest.raises(InvalidParam):
        llm.generate([[999_999]], SamplingParams(max_tokens=1))
    assert llm.engine.pool.num_free == free


def test_abort_frees_blocks(llm):
    eng = llm.engine
    free = eng.pool.num_free
    eng.add_request("a", llm.tokenizer.encode("to be aborted " * 10), SamplingParams(max_tokens=50))
    eng.step()
    assert eng.pool.num_free < free
    out = eng.abort_request("a")
    assert out.finished and out.finish_reason == "abort" and eng.pool.num_free == free
    assert eng.abort_request("a") is None


def test_bfloat16_runs_and_mostly_agrees():
    a = LLM(model="tiny-llama", dtype="bfloat16", device_blocks=16)
    out = a.generate("bf16 works", SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) == 4 and a.engine.kv_cache.dtype.is_floating_point
    assert str(a.engine.kv_cache.dtype) == "torch.bfloat16"
