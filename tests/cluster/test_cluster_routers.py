"""Two router replicas on their own hosts share one per-key rate limit through a Redis host: together
they admit the configured requests per minute, not twice that. With the Redis host's link down each
falls back to its own buckets (the documented fallback: up to N times the limit), and nothing fails."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
import yaml
from cluster.cluster_hosts import Cluster, unavailable
from cluster.figures import timed

from pdserve.bench.procs import pdserve_cmd, thread_env

pytestmark = pytest.mark.slow
RPM, KEYS = 120, ["sk-shared-1", "sk-shared-2"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    tmp = tmp_path_factory.mktemp("routers")
    with timed("router replicas (test_cluster_routers.py)"):
        yield from _replicas(tmp)


def _replicas(tmp):
    net = Cluster(["router-a", "router-b", "redis"], tmp)
    try:
        redis = net.hosts["redis"]
        net.start(
            redis,
            "redis",
            [
                "redis-server",
                "--bind",
                redis.ip,
                "--port",
                "6379",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--dir",
                str(tmp),
            ],
            6379,
        )
        cfg = tmp / "router.yaml"
        # Off loopback a router needs an admin key to start.
        cfg.write_text(
            yaml.safe_dump(
                {
                    "model": {"name": "tiny-qwen2"},
                    "router": {
                        "api_keys": KEYS,
                        "admin_keys": ["cluster-admin"],
                        "requests_per_minute": RPM,
                        "shared_limits": f"redis://{redis.ip}:6379/0",
                    },
                }
            )
        )
        routers = [
            net.start(
                net.hosts[n],
                n,
                pdserve_cmd() + ["router", "--config", str(cfg), "--host", net.hosts[n].ip, "--port", "8000"],
                8000,
                env=thread_env(1),
                health_path="/metrics",
            )
            for n in ("router-a", "router-b")
        ]
        for r in routers:
            r.wait_ready(timeout=120)
        yield net, routers
    finally:
        net.close()


def _hammer(urls: list[str], key: str, per_replica: int) -> tuple[int, int, float]:
    """GET /v1/models (answered by the router itself, rate-limited like any client call) from
    both replicas at once: (admitted, refused with 429, seconds)."""

    def one(url: str) -> list[int]:
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
            return [c.get(url + "/v1/models").status_code for _ in range(per_replica)]

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
        codes = [c for got in pool.map(one, urls) for c in got]
    assert set(codes) <= {200, 429}, set(codes)
    return codes.count(200), codes.count(429), time.monotonic() - t0


def test_two_router_replicas_share_one_limit(replicas):
    net, routers = replicas
    urls = [r.url for r in routers]
    admitted, refused, secs = _hammer(urls, KEYS[0], RPM)
    refill = RPM * secs / 60  # the bucket refills while the requests run
    print(
        f"REPLICAS shared rpm={RPM} admitted={admitted} refused={refused} seconds={secs:.1f} refill={refill:.1f}"
    )
    assert RPM * 0.95 <= admitted <= RPM * 1.05 + refill, (admitted, secs)

    # Redis unreachable: each replica falls back to its own buckets (documented: up to 2x here).
    net.link(net.hosts["redis"], up=False)
    try:
        admitted2, _, secs2 = _hammer(urls, KEYS[1], RPM)
    finally:
        net.link(net.hosts["redis"], up=True)
    print(f"REPLICAS fallback admitted={admitted2} seconds={secs2:.1f}")
    assert admitted2 >= 2 * RPM * 0.95
    for r in routers:
        assert "shared rate limits: Redis" in r.log_tail(200_000)
