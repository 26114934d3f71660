"""Rate limits shared by router replicas through a real Redis: two limiters (two replicas) on one
Redis admit the configured requests per minute together, not twice; tokens charged on one are
seen by the other; with Redis gone each falls back to its own buckets and nothing raises."""

from __future__ import annotations

import asyncio
import time

from redis_server import RedisServer

from pdserve.router.rate_limit import RateLimiter
from pdserve.router.shared_limits import SharedRateLimiter, rate_limiter


async def _admitted(limiters: list[RateLimiter], who: str, n: int) -> int:
    ok = 0
    for i in range(n):
        ok += await limiters[i % len(limiters)].check(who, time.monotonic()) == 0
    return ok


def test_two_replicas_share_one_request_budget():
    with RedisServer() as srv:

        async def run() -> None:
            a, b = SharedRateLimiter(60, None, srv.url), SharedRateLimiter(60, None, srv.url)
            try:
                got = await _admitted([a, b], "key-1", 200)
                # 60 in the bucket, plus what refills (1 a second) while the loop runs.
                assert 60 <= got <= 63, got
                wait = await a.check("key-1", time.monotonic())
                assert 0 < wait <= 1.0
                assert await _admitted([a, b], "key-2", 10) == 10  # buckets are per key
                assert a.fallbacks == b.fallbacks == 0
            finally:
                await a.close()
                await b.close()
            alone = [RateLimiter(60, None), RateLimiter(60, None)]
            assert await _admitted(alone, "key-1", 200) >= 120  # what replicas on their own let through

        asyncio.run(run())


def test_tokens_charged_on_one_replica_block_the_other():
    with RedisServer() as srv:

        async def run() -> None:
            a, b = SharedRateLimiter(None, 1000, srv.url), SharedRateLimiter(None, 1000, srv.url)
            try:
                assert await b.check("k", time.monotonic()) == 0
                a.charge_tokens("k", 1500, time.monotonic())
                await asyncio.gather(*a._pending)
                wait = await b.check("k", time.monotonic())
                assert wait > 20, wait  # ~500 tokens in debt at 1000 a minute: ~30 s
            finally:
                await a.close()
                await b.close()

        asyncio.run(run())


def test_redis_unreachable_falls_back_to_local_buckets():
    srv = RedisServer().start()
    url = srv.url
    srv.stop()

    async def run() -> None:
        lim = rate_limiter(5, None, url)
        assert isinstance(lim, SharedRateLimiter)
        try:
            t0 = time.monotonic()
            assert await _admitted([lim], "k", 8) == 5  # the local bucket, as a lone replica
            assert time.monotonic() - t0 < 5  # one timeout, then local until the retry
            assert lim.fallbacks == 8 and lim.shared == 0
        finally:
            await lim.close()

    asyncio.run(run())
    assert type(rate_limiter(5, None, None)) is RateLimiter
