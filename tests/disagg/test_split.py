"""Where a long prompt is cut for a pipeline of prefill workers (pure functions)."""

from __future__ import annotations

from pdserve.disagg.split import attention_weight, pipeline_parts, span_cost, split_points
from pdserve.model.arch import ModelArch


def test_cuts_give_equal_compute_not_equal_tokens():
    w = attention_weight(ModelArch())  # SmolLM2's shape: attention matters at 4,000 tokens
    cuts = split_points(0, 4000, 2, 16, w)
    assert len(cuts) == 3 and cuts[0] == 0 and cuts[-1] == 4000
    assert cuts[1] % 16 == 0 and cuts[1] > 2000  # the later chunk attends to more: it gets fewer tokens
    a, b = span_cost(0, cuts[1], w), span_cost(cuts[1], 4000, w)
    assert abs(a - b) / (a + b) < 0.01


def test_no_attention_weight_cuts_at_equal_token_counts():
    assert split_points(0, 4000, 2, 16, 0.0) == [0, 2000, 4000]
    assert split_points(64, 4000 + 64, 4, 16, 0.0) == [64, 1056, 2064, 3072, 4064]


def test_a_span_too_short_gives_fewer_chunks():
    assert split_points(0, 20, 4, 16, 0.0) == [0, 16, 20]
    assert split_points(0, 8, 2, 16, 0.0) == [0, 8]


def test_how_many_workers_share_a_prompt():
    assert pipeline_parts(4000, 2, 0) == 1  # off
    assert pipeline_parts(1000, 2, 2048) == 1  # too short
    assert pipeline_parts(4000, 1, 2048) == 1  # one peer
    assert pipeline_parts(4000, 2, 2048) == 2
    assert pipeline_parts(4000, 8, 2048) == 3  # one per min_tokens / 2
