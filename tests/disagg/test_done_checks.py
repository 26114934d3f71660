"""A prefill worker's PD_DONE is checked before anything reads it (disagg/trust.py done_problem): its
first token and logprob entry, and for a request that asked for prompt logprobs one entry per prompt
token (None for the first), each of the token it scores, with ids inside the vocabulary."""

from __future__ import annotations

from pdserve.common.outputs import TokenLogprob
from pdserve.disagg.trust import done_problem
from pdserve.protocol.pd import Done

VOCAB = 100
PROMPT = [5, 6, 7]


def _entries(tokens: list[int]) -> list:
    return [None] + [TokenLogprob(t, -1.0, 1, [(t, -1.0)]).to_wire() for t in tokens[1:]]


def _done(**kw) -> Done:
    return Done("r", "t", token=3, **kw)


def test_a_whole_answer_passes():
    assert done_problem(_done(), VOCAB) is None
    assert done_problem(_done(prompt_logprobs=_entries(PROMPT)), VOCAB, PROMPT) is None


def test_prompt_logprobs_must_be_one_per_prompt_token_of_those_tokens():
    bad = [
        None,  # asked for and missing
        _entries(PROMPT)[:2],  # one short
        [_entries(PROMPT)[1], *_entries(PROMPT)[1:]],  # the first is not None
        _entries([5, 6, 8]),  # the entry of another token
        [None, ["x"], _entries(PROMPT)[2]],  # malformed
        [None, *[TokenLogprob(t, -1.0, 1, [(VOCAB + 5, -1.0)]).to_wire() for t in PROMPT[1:]]],  # ids outside
    ]
    for entries in bad:
        assert done_problem(_done(prompt_logprobs=entries), VOCAB, PROMPT) is not None, entries


def test_the_first_token_and_its_entry():
    assert done_problem(Done("r", "t", token=VOCAB), VOCAB) is not None
    assert done_problem(_done(logprob=TokenLogprob(4, -1.0, 1, []).to_wire()), VOCAB) is not None
