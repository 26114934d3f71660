"""How many of its proposed draft tokens each request verifies this step: a pure function of the
batch, the requests' acceptance rates and the measured cost of a step by row count.

A draft token adds a row to the step, and a row costs what the machine says it costs: on some
CPUs a row more is nearly free (the weights are read once for all rows), on others (a quantized
product that widens each row's weights again) it costs almost as much as the first. So drafting
pays only where the tokens it is expected to add outweigh the time its rows add, and the answer
depends on the batch: the same draft that triples one stream's speed slows a batch of 32.

The model: request i's j-th draft token is emitted only if it and every draft before it are
accepted, with probability a_i ** j (a_i: the request's estimated per-token acceptance). The step
then emits B + sum of those probabilities tokens (B: the decode rows, each of which emits one
token whatever its drafts) in cost(B + drafts) seconds. The draft positions with the largest
probabilities are taken first (a request's earlier positions before its later ones), and the
count that gives the most tokens per second wins, if it beats no drafts by `min_gain`. A draft
model's own steps add their time for the deepest draft taken (each level is one step of it).
"""

from __future__ import annotations

from typing import Callable

# A draft must promise this much more throughput than none: estimates and costs are noisy, and
# a draft that is not clearly worth its rows should not risk a slower step.
MIN_GAIN = 1.03
# The least acceptance a request that has verified no draft of its own yet is credited with.
PROBE = 0.5


def acceptance(hits: int, misses: int, prior: float, weight: float = 2.0, probe: float = PROBE) -> float:
    """A per-token acceptance estimate from a request's own verified drafts (`hits` accepted tokens,
    `misses` rejections) and the engine-wide rate as a prior worth `weight` observations. A request
    with none of its own yet is credited with at least `probe`: the engine-wide rate alone would let
    the rejections of earlier traffic (free text, a warm-up) keep every later request from drafting,
    and so from ever measuring its own rate; its first verification settles what it is worth."""
    if hits + misses == 0:
        return max(prior, probe)
    return (hits + weight * prior) / (hits + misses + weight)


def choose(
    rows: int,
    drafts: list[tuple[int, float]],
    cost: Callable[[int], float],
    min_gain: float = MIN_GAIN,
    draft_cost: Callable[[int], float] | None = None,
) -> list[int]:
    """rows: decode rows of the step before drafts (>= 1); drafts: per candidate request, (tokens
    proposed, acceptance in [0, 1]); cost(r): seconds of a step of r rows; draft_cost(d): seconds of
    producing drafts d deep (a draft model's steps; None: free, as n-gram lookups are). Returns how
    many of its proposed tokens each candidate verifies (a prefix of its draft)."""
    positions = sorted(
        ((-(a**j), i, j) for i, (k, a) in enumerate(drafts) for j in range(1, k + 1) if a > 0.0)
    )
    base = rows / cost(rows)
    best_m, best_rate, tokens, depth = 0, base * min_gain, float(rows), 0
    for m, (neg_p, _, j) in enumerate(positions, 1):
        tokens -= neg_p
        depth = max(depth, j)
        rate = tokens / (cost(rows + m) + (draft_cost(depth) if draft_cost is not None else 0.0))
        if rate > best_rate:
            best_m, best_rate = m, rate
    out = [0] * len(drafts)
    for _, i, _ in positions[:best_m]:
        out[i] += 1
    return out
