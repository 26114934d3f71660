"""Workload generators: deterministic from seeds, exact request counts, documented bounds."""

import dataclasses
import json

import pytest

from pdserve.bench.client import poisson_arrivals
from pdserve.bench.workloads import SYNTHETIC, WORDS, count_requests, make_workload, words


def as_data(sessions):
    return [dataclasses.asdict(s) for s in sessions]


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_same_seed_same_workload_other_seed_differs(name):
    a = make_workload(name, 25, seed=7)
    b = make_workload(name, 25, seed=7)
    c = make_workload(name, 25, seed=8)
    assert as_data(a) == as_data(b)
    assert as_data(a) != as_data(c)
    assert count_requests(a) == 25


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
@pytest.mark.parametrize("n", [1, 2, 7])
def test_exact_request_count(name, n):
    assert count_requests(make_workload(name, n, seed=1)) == n


def nwords(text):
    return len(text.split())


def test_chat_lengths_within_documented_bounds():
    ss = make_workload("chat", 300, seed=3)
    lens = sorted(nwords(s.turns[0].text) for s in ss)
    outs = sorted(s.turns[0].max_tokens for s in ss)
    assert 8 <= lens[0] and lens[-1] <= 1024
    assert 16 <= outs[0] and outs[-1] <= 512
    # Median near the documented 120 words / 128 tokens (loose: 300 draws of a lognormal).
    assert 90 <= lens[150] <= 160
    assert 100 <= outs[150] <= 160
    assert all(len(s.turns) == 1 and s.system is None for s in ss)


def test_max_tokens_override_and_fixed_shape():
    assert {s.turns[0].max_tokens for s in make_workload("chat", 50, max_tokens=33)} == {33}
    ss = make_workload("fixed", 10, seed=0, max_tokens=64, input_len=100)
    assert {nwords(s.turns[0].text) for s in ss} == {100}
    assert {s.turns[0].max_tokens for s in ss} == {64}
    # Distinct prompts, so a prefix cache cannot turn a throughput test into a cache test.
    assert len({s.turns[0].text for s in ss}) == 10


def test_multiturn_structure():
    ss = make_workload("multiturn", 40, seed=2)
    assert all(1 <= len(s.turns) <= 6 for s in ss)
    assert all(len(s.turns) >= 2 for s in ss[:-1])  # only the last may be cut short
    assert all(s.system and 20 <= nwords(s.system) <= 60 for s in ss)
    assert [s.id for s in ss] == list(range(len(ss)))


def test_shared_prefix_reuses_few_prefixes():
    ss = make_workload("shared-prefix", 60, seed=4)
    prefixes = {s.system for s in ss}
    assert len(prefixes) <= 4
    assert all(nwords(p) == 800 for p in prefixes)
    assert len({s.turns[0].text for s in ss}) > 50


def test_interference_mixes_tagged_classes():
    ss = make_workload("interference", 200, seed=5)
    tags = [s.tag for s in ss]
    assert set(tags) == {"decode", "prefill"}
    assert 20 <= tags.count("prefill") <= 60  # 20% of 200, loosely
    for s in ss:
        t = s.turns[0]
        if s.tag == "prefill":
            assert nwords(t.text) >= 1024 and t.max_tokens == 16
        else:
            assert nwords(t.text) <= 128 and t.max_tokens == 256


def test_longdoc_is_long():
    ss = make_workload("longdoc", 20, seed=6)
    assert all(512 <= nwords(s.turns[0].text) <= 6000 + 20 for s in ss)


def test_words_are_vocabulary_words():
    import random

    text = words(random.Random(0), 200)
    vocab = set(WORDS)
    assert all(w.rstrip(".").lower() in vocab for w in text.split())
    assert nwords(text) == 200
    assert words(random.Random(0), 0) == ""


def test_jsonl_kinds_and_cycling(tmp_path):
    f = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 5, "tag": "p"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"turns": ["one", "two", "three"], "system": "sys"},
    ]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ss = make_workload(str(f), 7)
    assert count_requests(ss) == 7
    assert ss[0].turns[0].text == "hello there" and ss[0].turns[0].max_tokens == 5
    assert ss[0].tag == "p"
    assert ss[1].preset == [{"role": "system", "content": "be brief"}]
    assert ss[1].turns[0].text == "hi" and ss[1].turns[0].max_tokens == 128
    assert [t.text for t in ss[2].turns] == ["one", "two", "three"] and ss[2].system == "sys"
    # 1 + 1 + 3 = 5 requests; the file starts over: a prompt, then the messages line.
    assert [len(s.turns) for s in ss] == [1, 1, 3, 1, 1]
    # --max-tokens overrides the file's values.
    assert {t.max_tokens for s in make_workload(str(f), 3, max_tokens=9) for t in s.turns} == {9}


def test_jsonl_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError):
        make_workload(str(bad), 1)
    bad.write_text("not json\n")
    with pytest.raises(ValueError):
        make_workload(str(bad), 1)
    with pytest.raises(ValueError):
        make_workload("no-such-workload", 1)
    with pytest.raises(ValueError):
        make_workload("chat", 0)


def test_poisson_arrivals_deterministic_with_right_mean():
    a = poisson_arrivals(2000, rate=4.0, seed=1)
    assert a == poisson_arrivals(2000, rate=4.0, seed=1)
    assert a != poisson_arrivals(2000, rate=4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    mean_gap = a[-1] / (len(a) - 1)
    assert 0.22 <= mean_gap <= 0.28  # 1/rate = 0.25
