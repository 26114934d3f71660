"""The controller lease (control/leader.py) on a real redis-server: one router replica acts at a time,
another takes over when the holder releases it or stops renewing, and Redis lost means no new
leader. The lease's clock is the module's `monotonic`, set by the tests: no test waits on a
wall-clock expiry of its own (Redis's expiry is real, in milliseconds)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram
from redis_server import RedisServer

from pdserve.config import ConfigError, load_config
from pdserve.control import leader
from pdserve.control.controller import Controller
from pdserve.control.leader import LeaderLease
from pdserve.router.registry import Registry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(leader, "monotonic", c)
    return c


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


def test_one_holder_and_hand_over(redis_server, clock):
    async def go():
        a = LeaderLease(redis_server.url, "model-x", 15.0)
        b = LeaderLease(redis_server.url, "model-x", 15.0)
        other = LeaderLease(redis_server.url, "model-y", 15.0)  # another deployment, same Redis
        assert await a.renew() and a.held
        assert not await b.renew() and not b.held
        assert a.me in b.describe()
        assert await other.renew(), "a lease is per deployment"
        assert await a.renew(), "the holder renews its own lease"
        await a.release()
        assert not a.held
        assert await b.renew() and b.held, "a released lease is taken at the next renewal"
        assert not await a.renew()
        for x in (b, other):
            await x.release()

    asyncio.run(go())


def test_holder_that_stops_renewing_loses_it(redis_server, clock):
    async def go():
        a = LeaderLease(redis_server.url, "m", 0.2)  # Redis expires it after 200 ms
        b = LeaderLease(redis_server.url, "m", 0.2)
        assert await a.renew()
        clock.now += 0.1
        assert a.held
        clock.now += 0.2  # past a's own bound: it no longer acts, whatever Redis says
        assert not a.held
        for _ in range(200):  # Redis's expiry, on its clock
            if await b.renew():
                break
            await asyncio.sleep(0.02)
        assert b.held
        assert not await a.renew() and b.me in a.describe()
        await a.release()  # not the holder: b's lease stays
        assert await b.renew()
        await b.release()

    asyncio.run(go())


def test_redis_lost_no_new_leader(clock):
    async def go():
        srv = RedisServer().start()
        a = LeaderLease(srv.url, "m", 15.0, timeout_s=0.5)
        try:
            assert await a.renew()
            srv.stop()
            clock.now += 10.0
            assert await a.renew(), "within its lease the holder acts on: nobody else can hold it"
            clock.now += 6.0
            assert not await a.renew(), "past its lease it stops acting"
            assert "unreachable" in a.describe()
            b = LeaderLease(srv.url, "m", 15.0, timeout_s=0.5)
            assert not await b.renew(), "nobody takes a lease while Redis is unreachable"
            await b.release()
        finally:
            srv.stop()
            await a.release()

    asyncio.run(go())


def _controller(url: str, metrics: CollectorRegistry) -> Controller:
    config = load_config(overrides={"controller.enabled": True, "controller.leader_lease": url})
    ttft = Histogram("ttft", "", registry=metrics)
    itl = Histogram("itl", "", registry=metrics)
    registry = Registry(3, 5.0, 10.0, {})
    return Controller(config, registry, httpx.AsyncClient(), ttft, itl, None, metrics)


def test_only_the_lease_holder_acts(redis_server):
    async def go():
        ma, mb = CollectorRegistry(), CollectorRegistry()
        a, b = _controller(redis_server.url, ma), _controller(redis_server.url, mb)
        assert a.lease is not None and b.lease is not None
        await a.lease.renew()
        await b.lease.renew()
        da, db = await a.step(), await b.step()
        assert "lease" not in da.reason, da
        assert db.action == "hold" and a.lease.me in db.reason, db
        assert ma.get_sample_value("pdserve_controller_leader") == 1
        assert mb.get_sample_value("pdserve_controller_leader") == 0
        # The holder's controller stops: its run() hands the lease on.
        task = asyncio.create_task(a.run())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait([task], timeout=5)
        assert await b.lease.renew()
        assert "lease" not in (await b.step()).reason
        await b.lease.release()
        await a.client.aclose()
        await b.client.aclose()

    asyncio.run(go())


def test_one_router_needs_no_lease():
    config = load_config(overrides={"controller.enabled": True})
    metrics = CollectorRegistry()
    ttft, itl = Histogram("ttft", "", registry=metrics), Histogram("itl", "", registry=metrics)
    c = Controller(config, Registry(3, 5.0, 10.0, {}), httpx.AsyncClient(), ttft, itl, None, metrics)
    assert c.lease is None


@pytest.mark.parametrize(
    "key,value",
    [("controller.leader_lease", "http://redis:6379"), ("controller.lease_s", 1.0)],
)
def test_bad_lease_config_names_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(overrides={key: value})
    assert key in str(e.value)
