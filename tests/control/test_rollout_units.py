"""The pure parts of a rollout: the version label's digest, canary routing (router/policies.py
canary_pool), the SLO verdict read from the router's real /metrics exposition
(router/version_stats.py -> control/rollout_check.py), the canary weight's widening, and the
rollout config's rules."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.config import ConfigError, load_config
from pdserve.control.rollout_check import Reading, Slo, canary_weight, judge, read
from pdserve.router import policies
from pdserve.router.accounting import Route
from pdserve.router.policies import Canary, RouteRequest, WorkerState, canary_pool, choose
from pdserve.router.registry import Breaker, Worker
from pdserve.router.version_stats import VersionStats
from pdserve.version import config_digest, version_label

OLD, NEW = "0.1.0+aaaaaaaaaaaa", "0.1.0+bbbbbbbbbbbb"


# ------------------------------------------------------------------ version label


def test_the_digest_names_what_a_worker_runs_not_where_it_runs(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: {name: tiny-qwen2}\nscheduler: {max_num_seqs: 8}\n"
        "deployment: {decode: {max_num_seqs: 4, instances: 2}}\n"
    )
    base = config_digest(load_config(cfg))
    assert len(base) == 12 and base == config_digest(load_config(cfg))
    # Process identity, the router's and controller's sections and instance counts are no part of it ...
    same = {
        "worker.role": "decode",
        "server.port": 4321,
        "server.host": "0.0.0.0",
        "server.router_url": "http://r:1",
        "router.admin_keys": ["k"],
        "controller.enabled": True,
        "deployment.prefill.instances": 3,
        "cache.kv_events_endpoint": "tcp://127.0.0.1:*",
        "server.internal_token": "secret",
        "cache.disk_cache_dir": "/var/lib/pdserve/decode-7",  # each worker of a host has its own
    }
    assert config_digest(load_config(cfg, same)) == base
    # ... what the worker computes with is: a global key, a role's key, the model.
    for key, value in (
        ("scheduler.max_num_seqs", 16),
        ("deployment.decode.max_num_seqs", 5),
        ("model.name", "tiny-llama"),
        ("transfer.layerwise", False),
    ):
        assert config_digest(load_config(cfg, {key: value})) != base, key
    assert version_label(base) == f"0.1.0+{base}" and version_label(None) is None


def test_rollout_keys_are_checked():
    assert load_config(None, {"rollout.canary_weight": 1.0}).rollout.canary_weight == 1.0
    for key, bad in (
        ("rollout.canary_weight", 1.5),
        ("rollout.window_s", 0),
        ("rollout.max_error_rate", -0.1),
        ("rollout.slo_ttft_ms", 0),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, {key: bad})
        assert [k for k, _ in e.value.problems] == [key]


# ------------------------------------------------------------------ canary routing


def _ws(*specs: tuple[str, str | None], **kw) -> list[WorkerState]:
    return [WorkerState(wid, "decode", version=v, **kw) for wid, v in specs]


def test_canary_pool_sends_the_weight_to_the_new_version_first():
    ws = _ws(("a", OLD), ("b", OLD), ("c", NEW))
    c = Canary(NEW, 0.25)
    assert [w.worker_id for w in canary_pool(ws, c, 0.1)] == ["c"]
    assert [w.worker_id for w in canary_pool(ws, c, 0.25)] == ["a", "b"]
    assert canary_pool(ws, None, 0.0) is ws
    # One version in the pool (all old, all new): the whole pool, whatever the draw.
    assert canary_pool(_ws(("a", OLD)), c, 0.0) == _ws(("a", OLD))
    assert canary_pool(_ws(("c", NEW), ("d", NEW)), c, 0.9) == _ws(("c", NEW), ("d", NEW))


def test_canary_gives_way_when_its_group_has_no_eligible_worker():
    c = Canary(NEW, 1.0)
    new_down = [
        WorkerState("a", "decode", version=OLD),
        WorkerState("c", "decode", version=NEW, draining=True),
    ]
    assert [w.worker_id for w in canary_pool(new_down, c, 0.0)] == ["a"]
    old_full = [
        WorkerState("a", "decode", version=OLD, in_flight=4, capacity=4),
        WorkerState("c", "decode", version=NEW),
    ]
    assert [w.worker_id for w in canary_pool(old_full, Canary(NEW, 0.0), 0.5)] == ["c"]
    # Weight 0 with a serving old group: the new version takes nothing.
    assert [
        w.worker_id
        for w in canary_pool(new_down[:1] + [WorkerState("c", "decode", version=NEW)], Canary(NEW, 0.0), 0.0)
    ] == ["a"]


def test_the_canary_share_of_routed_requests_follows_the_weight():
    ws = _ws(("a", OLD), ("b", OLD), ("c", OLD), ("d", NEW))
    rng = random.Random(7)
    req = RouteRequest(100, 16, 16, {})
    picks = [
        choose("cost", req, canary_pool(ws, Canary(NEW, 0.1), rng.random()), counter=i).worker_id
        for i in range(4000)
    ]
    share = picks.count("d") / len(picks)
    assert 0.08 < share < 0.12, share  # without the canary the cost policy's rotation gives it 1/4
    assert {"a", "b", "c"} <= set(picks)
    assert "canary_pool" in policies.__all__


# ------------------------------------------------------------------ SLO verdict over a window


def _worker(wid: str, version: str | None) -> Worker:
    digest = version.split("+")[1] if version else None
    return Worker(wid, "decode", "http://x", Breaker(5, 1.0), pdserve_version="0.1.0", config_digest=digest)


def _request(
    stats: VersionStats, w: Worker, ttft_s: float, tpot_s: float, n: int, failed: bool = False
) -> None:
    """A request whose clock is set by hand: start at 0, first token at ttft_s, then a token per tpot_s."""
    r = stats.request()
    r.start = 0.0
    route = Route(w, None)
    r.attempt(route)
    r.attempt(route)  # a second attempt on the same version counts once
    if failed:
        r.failed(route)
    r.tokens(1, now=ttft_s)
    r.tokens(n - 1, now=ttft_s + tpot_s * (n - 1))
    r.close()


def test_the_verdict_reads_the_new_versions_figures_between_two_readings():
    reg = CollectorRegistry()
    stats = VersionStats(reg)
    old, new = _worker("a", OLD), _worker("b", NEW)
    for _ in range(20):
        _request(stats, old, 5.0, 1.0, 10)  # the old version is slow: not judged
    _request(stats, new, 5.0, 1.0, 10)  # before the window
    before = read(generate_latest(reg).decode(), NEW)
    assert before.requests == 1 and before.ttft
    for _ in range(10):
        _request(stats, new, 0.04, 0.02, 10)
    after = read(generate_latest(reg).decode(), NEW)
    slo = Slo(ttft_ms=100, tpot_ms=50, max_error_rate=0.05)
    v = judge(before, after, slo)
    assert (
        v.ok
        and v.requests == 10
        and v.error_rate == 0
        and 25 < v.ttft_p90_ms <= 50
        and 10 < v.tpot_p90_ms <= 25
    ), v
    strict = judge(before, after, Slo(ttft_ms=20, tpot_ms=50, max_error_rate=0.05))
    assert not strict.ok and "TTFT p90" in strict.reason and "TPOT" not in strict.reason
    _request(stats, new, 0.04, 0.02, 10, failed=True)
    failing = judge(before, read(generate_latest(reg).decode(), NEW), slo)
    assert not failing.ok and "error rate 0.091" in failing.reason


def test_no_request_in_the_window_passes_and_says_so():
    v = judge(Reading(), Reading(), Slo(1, 1, 0))
    assert v.ok and "no request" in v.reason
    assert read("", NEW) == Reading()
    # A request that failed before any token: an error, no latency.
    assert not judge(Reading(), Reading(requests=1, errors=1), Slo(1, 1, 0.5)).ok


def test_the_canary_weight_widens_from_its_first_value_to_one():
    ws = [canary_weight(i, 4, 0.1) for i in range(4)]
    assert ws[0] == 0.1 and ws == sorted(ws) and ws[-1] < 1.0
    assert canary_weight(1, 2, 0.0) == 0.5 and canary_weight(0, 0, 0.2) == 1.0


# ------------------------------------------------------------------ the command line


def test_rollout_cli_exits_2_on_a_bad_config_and_1_when_the_router_is_unreachable(tmp_path, capsys):
    from pdserve.bench.procs import free_port
    from pdserve.control.rollout import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {canary_weight: 2}\n")
    assert main(["--config", str(bad)]) == 2
    assert "rollout.canary_weight" in capsys.readouterr().err
    assert main(["--config", str(bad), "--canary-weight", "0.5", "--window-s", "0"]) == 2
    assert "rollout.window_s" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("model: {name: tiny-qwen2}\n")
    assert main(["--config", str(good), "--router", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "GET /admin/workers" in capsys.readouterr().err


def test_admin_calls_never_reuse_a_connection_the_router_may_have_closed():
    """A server that answers one request per connection and drops the next one sent on it, as a router
    does when a connection idled past its keep-alive while the rollout waited: every call still gets
    its answer, because each goes on a fresh connection."""
    import json as _json
    import socket
    import threading

    from pdserve.control.rollout import Admin

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    body = _json.dumps({"workers": []}).encode()

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                conn.recv(65536)  # a second request on this connection: dropped unanswered

    threading.Thread(target=serve, daemon=True).start()
    try:
        admin = Admin(f"http://127.0.0.1:{srv.getsockname()[1]}", None, timeout_s=10)
        for _ in range(3):
            assert admin.workers() == {}
    finally:
        srv.close()
