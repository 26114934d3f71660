"""A worker giving up some of its streams (`POST /internal/shed`, AsyncEngine.evacuate with a count):
the generating streams with the most tokens still to go get RequestMoved, the others go on and
finish; requests without a stream and streams not yet generating stay; every block comes back."""

from __future__ import annotations

import asyncio

from pdserve import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, RequestMoved


def test_shed_moves_the_streams_with_the_most_to_go():
    llm = LLM(model="tiny-llama", device_blocks=256, max_num_batched_tokens=64)
    eng = AsyncEngine(llm.engine)
    eng.start()
    free_at_start = llm.engine.pool.num_free
    prompt = llm.tokenizer.encode("move some of these streams elsewhere")
    # Long enough that none can finish while the others are being given up.
    max_tokens = {"short": 150, "long": 1500, "middle": 900}

    async def run() -> dict[str, object]:
        started = {rid: asyncio.Event() for rid in max_tokens}

        async def stream(rid: str) -> object:
            got = 0
            try:
                async for out in eng.generate(
                    rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens[rid], ignore_eos=True)
                ):
                    got += len(out.new_token_ids)
                    if got >= 2:
                        started[rid].set()
            except RequestMoved:
                return "moved"
            return got

        tasks = {rid: asyncio.create_task(stream(rid)) for rid in max_tokens}
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
        moved = await asyncio.wrap_future(eng.evacuate("evening out", count=2))
        results = {rid: await asyncio.wait_for(t, 120) for rid, t in tasks.items()}
        return {"moved": moved, **results}

    try:
        got = asyncio.run(run())
        assert got == {"moved": 2, "long": "moved", "middle": "moved", "short": 150}
        # A count of 0 moves nothing; a request without a consumer is never counted as a stream.
        assert eng.evacuate("nothing", count=0).result(timeout=30) == 0
        assert not llm.engine.has_unfinished()
        assert llm.engine.pool.num_free == free_at_start
    finally:
        eng.shutdown()
