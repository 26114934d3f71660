"""The profile's neighbour timings: every request it times is a prompt of its own, so no timing
hits the prefix cache with a prompt an earlier one computed (the prefill ratio read a cached step
as the contended one, and came out 1.00 whatever the machine did)."""

from __future__ import annotations

import contextlib
import random

from pdserve import LLM
from pdserve.planner import contention


def test_every_timed_request_is_a_prompt_of_its_own(monkeypatch):
    engine = LLM(model="tiny-llama", device_blocks=128).engine
    prompts = []
    add = engine.add_request

    def recording(rid, ids, params, **kw):
        prompts.append(tuple(ids))
        return add(rid, ids, params, **kw)

    monkeypatch.setattr(engine, "add_request", recording)
    # No neighbour process here: this is about what is timed, not how much a neighbour slows it.
    monkeypatch.setattr(contention, "_Neighbour", lambda kind, hidden: contextlib.nullcontext())
    rng = random.Random(0)
    decode, prefill = contention.neighbour_slowdown(
        engine, [rng.randrange(3, 30000) for _ in range(512)], 30000, chunk=32
    )
    assert decode >= 1.0 and prefill >= 1.0
    assert len(prompts) >= 4 and len(set(prompts)) == len(prompts)
    assert not engine.has_unfinished()
