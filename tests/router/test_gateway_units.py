"""The router's small parts: circuit breaker, keys, token buckets, allowlist, admission queue."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.access import KeyStore, hash_key, key_id
from pdserve.router.admission import Admission
from pdserve.router.rate_limit import RateLimiter
from pdserve.router.registry import Breaker, BreakerState
from pdserve.router.security import Allowlist
from pdserve.server.errors import APIError


def test_breaker_opens_probes_and_closes():
    b = Breaker(failures_to_open=3, cooldown_s=5.0)
    for t in (0.0, 0.1):
        b.on_failure(t)
        assert b.allows(t) and b.state == BreakerState.CLOSED
    b.on_failure(0.2)
    assert b.state == BreakerState.OPEN and not b.allows(1.0)
    assert b.allows(5.3) and b.state == BreakerState.HALF_OPEN  # cooldown over: one probe
    b.on_attempt()
    assert not b.allows(5.4)  # only one probe at a time
    b.on_failure(5.5)
    assert b.state == BreakerState.OPEN and not b.allows(6.0)  # the probe failed: open again
    assert b.allows(10.6)
    b.on_attempt()
    b.on_success()
    assert b.state == BreakerState.CLOSED and b.failures == 0 and b.allows(10.7)


def test_success_resets_the_failure_count():
    b = Breaker(failures_to_open=2, cooldown_s=1.0)
    b.on_failure(0.0)
    b.on_success()
    b.on_failure(0.1)
    assert b.state == BreakerState.CLOSED


def test_keys_are_hashed_and_identified(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEYS", "env-key-1, env-key-2")
    ks = KeyStore(["cfg-key"])
    assert ks.enabled and len(ks.digests) == 3
    assert all(isinstance(d, bytes) and b"key" not in d for d in ks.digests)
    assert ks.identify("cfg-key") == key_id(hash_key("cfg-key"))
    assert ks.identify("env-key-2") is not None
    assert ks.identify("nope") is None and ks.identify("") is None
    assert "cfg-key" not in key_id(hash_key("cfg-key"))


def test_request_and_token_buckets():
    rl = RateLimiter(rpm=2, tpm=100)
    assert rl.admit("k", 0.0) == 0 and rl.admit("k", 0.0) == 0
    wait = rl.admit("k", 0.0)
    assert 29 < wait <= 30  # 2/min: one more after 30 s
    assert rl.admit("other", 0.0) == 0  # buckets are per key
    assert rl.admit("k", 31.0) == 0
    rl.charge_tokens("other", 150, 1.0)  # a big request overdraws the bucket...
    assert rl.admit("other", 1.0) > 0  # ...and the key waits until it refills
    assert rl.admit("other", 40.0) == 0


def test_allowlist():
    assert Allowlist([]).allows("1.2.3.4")
    a = Allowlist(["10.0.0.0/8", "::1/128"])
    assert a.allows("10.1.2.3") and a.allows("::1")
    assert not a.allows("127.0.0.1") and not a.allows(None) and not a.allows("garbage")


def test_admission_queue_bounds_and_timeout():
    async def run():
        adm = Admission(max_concurrent=1, max_queue=1, timeout_s=0.2)
        release = asyncio.Event()

        async def holder():
            async with adm.slot():
                await release.wait()

        async def waiter():
            async with adm.slot():
                return "served"

        h = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        w = asyncio.create_task(waiter())  # queued
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as full:  # the queue is full
            async with adm.slot():
                pass
        assert full.value.status == 503 and full.value.headers["Retry-After"]
        release.set()
        assert await w == "served"
        await h
        assert adm.active == 0 and adm.waiting == 0
        release.clear()
        h = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as late:  # waited past the timeout
            async with adm.slot():
                pass
        assert late.value.status == 503
        release.set()
        await h

    asyncio.run(run())
