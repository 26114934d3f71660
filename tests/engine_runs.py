"""Running an offline engine to the end in tests: every output token by request, and the KV pools
(the draft model's too) back at their start."""

from __future__ import annotations

from pdserve import SamplingParams
from pdserve.engine.engine import LLMEngine

# Prompts that repeat themselves, so n-gram drafts find matches (and a draft model has text to follow).
REPEATS = [[5, 6, 7, 8] * 6, [(7 * i + 3) % 250 + 1 for i in range(30)], [9, 10, 11] * 5 + [9, 10]]


def generate(engine: LLMEngine, batch: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Runs the batch (request ids r0, r1, ... made unique per call) until it finishes."""
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}-{engine.num_steps}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id.split("-")[0], []).extend(o.new_token_ids)
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()
    if engine.drafter is not None:
        assert engine.drafter.pool.num_free == engine.drafter.pool.num_blocks
        assert not engine.drafter.seqs
    return out
