"""A second request with the id of one the engine is running is refused (DuplicateRequestId, a 409
on the internal API) and never reads the first one's tokens; the first goes on undisturbed, and the
id is free again once it finished. (The internal API over real processes: tests/router/
test_hostile_requests_e2e.py.)"""

from __future__ import annotations

import asyncio

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, DuplicateRequestId


def test_a_duplicate_id_is_refused_and_the_first_request_keeps_its_tokens():
    llm = LLM(model="tiny-llama", device_blocks=128, max_num_batched_tokens=64)
    eng = AsyncEngine(llm.engine)
    eng.start()
    free = llm.engine.pool.num_free
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    first_prompt, other_prompt = [5, 6, 7, 8], [9, 10, 11]

    async def collect(prompt: list[int], started: asyncio.Event | None = None) -> list[int]:
        tokens: list[int] = []
        async for out in eng.generate("same", prompt, params):
            tokens.extend(out.new_token_ids)
            if started is not None:
                started.set()
        return tokens

    async def go() -> tuple[list[int], list[int]]:
        started = asyncio.Event()
        first = asyncio.create_task(collect(first_prompt, started))
        await asyncio.wait_for(started.wait(), 60)
        with pytest.raises(DuplicateRequestId):
            await collect(other_prompt)
        got = await asyncio.wait_for(first, 120)
        return got, await asyncio.wait_for(collect(first_prompt), 120)

    try:
        got, again = asyncio.run(go())
        assert len(got) == 400 and again == got
        assert eng.dead is None and llm.engine.pool.num_free == free
    finally:
        eng.shutdown()
