"""Fixtures of the cache tests: a real redis-server (from tests/redis_server.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_helper():
    # tests/ is not a package (pytest runs with --import-mode=importlib): load the helper by path.
    name = "pdserve_tests_redis_server"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "redis_server.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


redis_helper = _load_helper()


@pytest.fixture
def redis_server():
    with redis_helper.RedisServer() as server:
        yield server
