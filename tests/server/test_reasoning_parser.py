"""The reasoning parsers (common/reasoning.py): where the reasoning ends and the answer starts, for
deepseek_r1 (reasoning from the first token) and qwen3 (only after an opening <think>), and that any
way of cutting the output into stream deltas gives back the same two texts, a tag cut anywhere."""

from __future__ import annotations

import random

import pytest

from pdserve.common.reasoning import ReasoningParser, split


@pytest.mark.parametrize(
    "kind, text, want",
    [
        ("deepseek_r1", "Let me think.</think>Paris.", ("Let me think.", "Paris.")),
        ("deepseek_r1", "<think>\nhmm</think>\n\nParis.", ("\nhmm", "\n\nParis.")),
        ("deepseek_r1", "no end tag at all", ("no end tag at all", "")),
        ("deepseek_r1", "</think>Paris.", ("", "Paris.")),
        ("qwen3", "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
        ("qwen3", "Paris. <think>not reasoning</think>", ("", "Paris. <think>not reasoning</think>")),
        ("qwen3", "  <think>open, never closed", ("open, never closed", "")),
        ("qwen3", "<thi", ("", "<thi")),
        ("qwen3", "", ("", "")),
        ("deepseek_r1", "a </think> b </think> c", ("a ", " b </think> c")),
    ],
)
def test_split(kind, text, want):
    assert split(kind, text) == want


@pytest.mark.parametrize("kind", ["deepseek_r1", "qwen3"])
def test_any_stream_cut_adds_up_to_the_whole_answer(kind):
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n", "Paris", "<th", "k>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        p = ReasoningParser(kind)
        r, c, prev = "", "", 0
        for at in [*cuts, len(text)]:
            dr, dc = p.feed(text[prev:at])
            r, c, prev = r + dr, c + dc, at
        dr, dc = p.finish()
        assert (r + dr, c + dc) == split(kind, text), (text, cuts)


def test_unknown_parser():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningParser("mystery")
