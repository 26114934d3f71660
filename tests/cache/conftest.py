"""Fixtures of the cache tests: a real redis-server (tests/redis_server.py), and tier stores that
are closed after each test."""

from __future__ import annotations

import pytest
from redis_server import RedisServer

from pdserve.cache.tiers.manager import TieredKVStore


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def stores(request):
    """Makes TieredKVStores with the test module's block size (`BS`); closes them all afterwards."""
    made: list[TieredKVStore] = []

    def make(**kw) -> TieredKVStore:
        made.append(TieredKVStore(request.module.BS, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
