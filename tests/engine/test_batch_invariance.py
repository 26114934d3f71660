"""Each prompt's greedy output is the same alone, in a batch, chunked, and under preemption (float32:
quantization none throughout, as smollm_llm, which computes the outputs alone)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of Italy?",
    "Name a famous painter.",
    "Why is the sky blue?",
    "Write one sentence about cats.",
    "What is 2 plus 2?",
    "Describe a rainy day.",
    "What do bees make?",
    "Tell me a fun fact about space.",
    "How do plants drink water?",
    "What is a prime number?",
    "Suggest a name for a dog.",
    "What language is spoken in Brazil?",
    "Give me a synonym for happy.",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "What is the largest ocean?",
]
PARAMS = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def prompts(smollm_llm):
    return [smollm_llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(smollm_llm, prompts):
    return [smollm_llm.generate([p], PARAMS)[0].token_ids for p in prompts[:8]]


def _check(llm: LLM, prompts, expected) -> list:
    free = llm.engine.pool.num_free
    outs = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs[: len(expected)]] == expected
    assert llm.engine.pool.num_free == free == llm.engine.pool.num_blocks
    return outs


@pytest.mark.slow
def test_batch_of_16(smollm_llm, prompts, alone):
    _check(smollm_llm, prompts, alone)


@pytest.mark.slow
def test_chunked_prefill_16(smollm_files, prompts, alone):
    llm = LLM(model="smollm2-135m", loaded=smollm_files, max_num_batched_tokens=16, quantization="none")
    _check(llm, prompts[:8], alone)


@pytest.mark.slow
def test_preemption_with_tiny_block_budget(smollm_files, prompts, alone):
    # 10 blocks of 16 tokens: three ~40-token prompts are admitted, then outgrow the pool while decoding.
    llm = LLM(model="smollm2-135m", loaded=smollm_files, device_blocks=10, quantization="none")
    _check(llm, prompts[:8], alone)
    assert llm.engine.preemptions_total > 0
