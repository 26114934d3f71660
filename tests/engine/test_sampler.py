"""Sampling: filters, penalties, seeds and logprobs on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.common.errors import InvalidParam
from pdserve.common.sampling import SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.sampler import apply_penalties, filter_logits, sample


def _req(rid="r", prompt=(1, 2), out=(), **kw) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**kw))
    for t in out:
        r.append_token(t)
    return r


def test_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0, 0.0)).tolist() == [False, False, True, True, True]
    # min_p 0.3: keep tokens with prob >= 0.3 * max prob; exp(-1) = 0.37 stays, exp(-2) = 0.14 goes.
    assert torch.isinf(filter_logits(logits, 0, 1.0, 0.3)).tolist() == [False, False, True, True, True]
    probs = logits.softmax(-1)
    kept = ~torch.isinf(filter_logits(logits, 0, float(probs[0]) + 1e-4, 0.0))
    assert kept.tolist() == [True, True, False, False, False]
    assert (~torch.isinf(filter_logits(logits, 0, 0.01, 0.0))).sum() == 1


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    out = apply_penalties(logits.clone(), _req(prompt=(0, 1), out=(2, 2), repetition_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 0.5, 1.0]
    out = apply_penalties(
        logits.clone(), _req(prompt=(0,), out=(2, 2, 3), frequency_penalty=0.5, presence_penalty=0.25)
    )
    assert out.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]


def test_greedy_and_seeded_sampling_are_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy, _, _ = sample(logits, [_req(f"g{i}", temperature=0) for i in range(3)])
    assert greedy == logits.argmax(-1).tolist()

    def run(logits: torch.Tensor, reqs: list, steps: int = 20) -> list[list[int]]:
        seq = []
        for _ in range(steps):
            tokens, _, _ = sample(logits, reqs)
            for r, t in zip(reqs, tokens):
                r.append_token(t)  # the next draw is the request's next output index
            seq.append(tokens)
        return seq

    draws = [
        run(logits[:2], [_req("s", temperature=1.0, seed=42), _req("t", temperature=1.0, seed=7)])
        for _ in range(2)
    ]
    assert draws[0] == draws[1]
    # The same seeded request alone gives the same draws as inside the batch.
    assert [d[0] for d in run(logits[:1], [_req("s", temperature=1.0, seed=42)])] == [d[0] for d in draws[0]]
    assert len({d[0] for d in draws[0]}) > 1  # it really samples
    # A draw depends on the seed and its index only: a copy that starts at output 10 draws the same.
    later = _req("s", temperature=1.0, seed=42, out=tuple(d[0] for d in draws[0][:10]))
    assert [d[0] for d in run(logits[:1], [later], 10)] == [d[0] for d in draws[0][10:]]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    req = _req(temperature=1.0, seed=3)
    counts = [0, 0, 0]
    for _ in range(2000):
        t = sample(logits, [req])[0][0]
        req.append_token(t)
        counts[t] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[2] / 2000 - 0.1) < 0.03


def test_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    _, lps, _ = sample(logits, [_req(temperature=0, logprobs=2)])
    lp = lps[0]
    expect = logits[0].log_softmax(-1)
    assert lp.token_id == 1 and lp.rank == 1 and math.isclose(lp.logprob, float(expect[1]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
def test_validation_names_the_param(kw, param):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == param


@pytest.mark.parametrize(
    "field, value", [("temperature", 1e-40), ("temperature", float("nan")), ("repetition_penalty", 1e-40)]
)
def test_a_row_that_cannot_be_sampled_fails_alone(field, value):
    # Values validation refuses (set after it, as a bug or a bypass would): the row's probabilities
    # are NaN, its draw raises; the other rows of the batch are sampled as they are without it.
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 10
    logits[1, 1:3] = 5.0  # the prompt's tokens: a repetition penalty divides positive logits
    reqs = [
        _req("a", temperature=0.7, seed=5, logprobs=1),
        _req("bad", temperature=1.0, seed=6, logprobs=1),
        _req("c", temperature=0, logprobs=1),
    ]
    setattr(reqs[1].params, field, value)
    tokens, lps, failed = sample(logits, reqs)
    assert set(failed) == {1} and "RuntimeError" in failed[1]
    want, want_lps, none = sample(
        logits[[0, 2]], [_req("a", temperature=0.7, seed=5, logprobs=1), _req("c", temperature=0, logprobs=1)]
    )
    assert none == {} and [tokens[0], tokens[2]] == want and [lps[0], lps[2]] == want_lps and lps[1] is None
