"""Greedy output of the offline engine == HF transformers' greedy output, on the real default model."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\nx = np.",
]
CHAT = [
    "What is the capital of Japan?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
]


@pytest.mark.slow
def test_greedy_matches_hf(smollm_llm, hf_reference):
    tok = smollm_llm.tokenizer
    prompts = [tok.encode(p) for p in PLAIN] + [
        tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT
    ]
    params = SamplingParams(temperature=0, max_tokens=32)
    ours = smollm_llm.generate(prompts, params)
    eos = smollm_llm.engine.arch.eos_token_ids
    differing = 0
    for ids, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_reference.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
            )[0, len(ids) :].tolist()
        if ref == out.token_ids:
            continue
        differing += 1
        # At the first divergence both tokens must be near-ties: each in the other's top-5.
        k = next(i for i, (a, b) in enumerate(zip(ref + [-1], out.token_ids + [-1])) if a != b)
        with torch.no_grad():
            logits = hf_reference(torch.tensor([ids + ref[:k]])).logits[0, -1]
        top5 = logits.topk(5).indices.tolist()
        assert out.token_ids[k] in top5, f"prompt {ids[:8]}: ours {out.token_ids[k]} not in HF top-5 {top5}"
        ours_lp = smollm_llm.generate(
            [ids + ref[:k]], SamplingParams(temperature=0, max_tokens=1, logprobs=5)
        )
        assert ref[k] in [t for t, _ in ours_lp[0].logprobs[0].top]
    print(f"HF parity: {differing} of {len(prompts)} prompts differ")
    assert differing <= 1, f"{differing} of {len(prompts)} greedy outputs differ from HF"
