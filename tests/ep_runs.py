"""Expert-parallel runs against EP=1 in tests: the prompts, the sampling, and the comparison."""

from __future__ import annotations

import torch

from pdserve import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)


def assert_same(got, want, tol: float = 1e-4) -> None:
    """The same greedy tokens, and each step's top logprobs: the same tokens, values within `tol`
    (EP sums the experts' outputs in another order than EP=1)."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in a.top]),
                torch.tensor([lp for _, lp in b.top]),
                atol=tol,
                rtol=tol,
            )
