"""logit_bias: added to a token's logit before sampling (after penalties, before temperature and
filters), on every path that samples: the colocated engine, a prefill worker's first token and the
decode worker's steps (real sockets, in-process engines); logprobs stay the model's own; bad maps are
refused naming logit_bias, and JSON's string keys become token ids."""

from __future__ import annotations

import pytest
import torch
from pd_harness import mixed_outputs, pd_pair, prompts

from pdserve import SamplingParams
from pdserve.common.errors import InvalidParam
from pdserve.engine.request import Request
from pdserve.engine.sampler import sample

V = 64


def _req(i: int, **params) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(**params))


def test_a_bias_moves_greedy_and_sampled_rows_and_leaves_logprobs_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    top = logits.argmax(-1).tolist()
    reqs = [
        _req(0, temperature=0, logit_bias={7: 100.0}, logprobs=1),
        _req(1, temperature=0, logit_bias={top[1]: -100.0}),
        _req(2, temperature=1.0, seed=3, logit_bias={11: 100.0}),
        _req(3, temperature=0),  # unbiased rows of the batch are untouched
    ]
    tokens, logprobs, failed = sample(logits.clone(), reqs)
    assert not failed
    assert tokens[0] == 7 and tokens[2] == 11 and tokens[3] == top[3]
    assert tokens[1] != top[1] and tokens[1] == int(logits[1].topk(2).indices[1])
    want = float(logits[0].double().log_softmax(-1)[7])  # the model's own distribution
    assert logprobs[0] is not None and abs(logprobs[0].logprob - want) <= 1e-5 * max(1.0, abs(want))


def test_json_keys_become_token_ids_and_bad_maps_are_refused():
    assert SamplingParams(logit_bias={"5": 1.5, "-0": 2}).logit_bias == {5: 1.5, 0: 2}
    for bad in (
        {"x": 1.0},
        {"5": 101.0},
        {"5": float("nan")},
        {str(i): 1.0 for i in range(1025)},
        {"5": True},
    ):
        with pytest.raises(InvalidParam) as e:
            SamplingParams(logit_bias=bad).validate(V)
        assert e.value.param == "logit_bias"
    with pytest.raises(InvalidParam):
        SamplingParams(logit_bias={V: 1.0}).validate(V)  # outside the vocabulary


def test_pd_applies_the_bias_to_the_prefill_workers_first_token_and_every_step():
    ps = prompts(3)
    forced = SamplingParams(temperature=0, max_tokens=6, logit_bias={"42": 100.0})
    nudged = SamplingParams(temperature=0, max_tokens=8, logit_bias={42: 3.0, 17: -2.0})
    want = mixed_outputs(ps, nudged)
    with pd_pair() as (prefill, decode):
        decode.run(ps, forced)
        assert all(decode.outputs[f"r{i}"] == [42] * 6 for i in range(3)), decode.outputs
        decode.outputs.clear()
        decode.finished.clear()
        decode.run(ps, nudged)
        assert decode.outputs == want  # the same tokens as the colocated engine
        decode.wait_idle()
        prefill.wait_idle()
