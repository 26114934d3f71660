"""PD across hosts (network namespaces): the default deployment over real links, then faults under
streaming load. Each fault asserts that every request completes with the fault-free greedy output
or fails with a clear error within its deadline, and that every KV pool returns to its start; its
figures (tests/cluster/figures.py) print as one table after the run. Every process exports its
trace spans to a real OTLP receiver in the test process: one request is one trace across hosts,
a migrated one included."""

from __future__ import annotations

import functools
import threading
import time

import httpx
import pytest
from cluster.cluster_hosts import ShapingUnavailable, unavailable, wait_until
from cluster.figures import record, timed
from cluster.pd_cluster import ADMIN, CONFIG, MODEL, ROLES, SLOW_PREFILL, TOKEN, PDCluster, prompt, recovery_s
from cluster.traces import check_migrated_trace, check_one_trace

from pdserve.protocol import INTERNAL_TOKEN_HEADER
from pdserve.server.openai_api import PREFILL_HEADER

pytestmark = pytest.mark.slow
MAX_TOKENS = 64
# Streams a mid-stream fault must land in: long enough to outlast the fault's own latency on a fast
# CPU (64 tokens of tiny-qwen2 streamed in 0.35 s on a Zen 4; on a Zen 5 six streams of 384 ended
# between two polls of the workers' /health). Four such streams fit one decode host's 256 blocks.
FAULT_TOKENS = 768


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    from otlp_receiver import Receiver

    rx = Receiver("0.0.0.0")
    with timed("PD cluster (test_cluster_pd.py)"):
        c = PDCluster(tmp_path_factory.mktemp("cluster"), otlp_port=rx.port)
        c.receiver = rx
        try:
            yield c
        finally:
            c.close()
            rx.close()


@functools.lru_cache(maxsize=None)
def _offline():
    from pdserve import LLM

    return LLM(model=MODEL)


@functools.lru_cache(maxsize=None)
def want(i: int, max_tokens: int = MAX_TOKENS) -> str:
    """The fault-free greedy text of prompt(i): the offline engine's."""
    from pdserve import SamplingParams

    return (
        _offline()
        .generate(prompt(i), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        .text
    )


def _requests(c: PDCluster) -> dict[str, int]:
    return {n: w["requests"] for n, w in c.workers().items()}


def test_default_deployment_across_hosts(cluster):
    ws = cluster.workers()
    assert sorted(ws) == sorted(ROLES), ws
    for name, w in ws.items():  # each registered itself from its own host, at its own address
        assert w["role"] == ROLES[name] and w["healthy"]
        assert w["url"] == cluster.host(name).url(8000)
    other = cluster.workers("router-b")  # ... with both router replicas
    assert sorted(other) == sorted(ROLES) and all(w["healthy"] for w in other.values()), other
    outs = cluster.load([prompt(i) for i in range(6)], MAX_TOKENS)
    for i, o in enumerate(outs):
        assert o.error is None and o.text == want(i), (i, o)
    # transfer.backend auto picked tcp: the KV bytes came in over the decode workers' sockets.
    dec = [cluster.health(n) for n in ("decode-a", "decode-b")]
    assert sum(h["kv_recv_tcp_bytes_total"] for h in dec) > 0, dec
    assert sum(h["kv_transfers_completed_total"] for h in dec) >= 6
    assert all(h["kv_local_prefill_fallbacks_total"] == 0 for h in dec)
    # KV events crossed the network into the router's index.
    wait_until(
        lambda: all(w["kv_index_blocks"] > 0 for n, w in cluster.workers().items() if n.startswith("decode")),
        30,
        "the router's KV index to learn both decode workers' blocks",
    )
    cluster.idle_pools()


def test_one_trace_across_hosts(cluster):
    check_one_trace(cluster)


def test_follow_up_goes_to_the_decode_worker_holding_its_prefix(cluster):
    placed = {}
    for i in range(10, 14):
        before = _requests(cluster)
        r = httpx.post(
            cluster.router.url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": prompt(i, 160), "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        [placed[i]] = [n for n, k in _requests(cluster).items() if n.startswith("decode") and k > before[n]]
    wait_until(
        lambda: all(cluster.workers()[n]["kv_index_blocks"] >= 10 for n in placed.values()),
        30,
        "the index to hold the prompts' blocks",
    )
    for i in range(10, 14):
        before = _requests(cluster)
        r = httpx.post(
            cluster.router.url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": prompt(i, 160) + [7, 8, 9], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        got = [n for n, k in _requests(cluster).items() if n.startswith("decode") and k > before[n]]
        assert got == [placed[i]], (i, placed, got)
    cluster.idle_pools()


def _busy(c: PDCluster, indexed: bool = False) -> str | None:
    """The decode host with most streams decoding (with `indexed`: among those whose blocks the
    router's KV index holds), or None. Read off the workers' running batches, not the router's
    in-flight count: that one counts requests still waiting for their prefill, and a fault that meets
    only those is a retry, not the migration a test wants."""
    running = {n: c.health(n)["running"] for n in ROLES if n.startswith("decode")}
    busy = [n for n, k in running.items() if k and (not indexed or c.workers()[n]["kv_index_blocks"])]
    return max(busy, key=running.get) if busy else None


def _check(outs, first: int, deadline_s: float, max_tokens: int = MAX_TOKENS) -> tuple[int, int]:
    """Every request has the fault-free text, or a clear error within its deadline; (ok, failed)."""
    ok = failed = 0
    for i, o in enumerate(outs, first):
        if o.error is None:
            assert o.text == want(i, max_tokens), (i, o)
            ok += 1
        else:
            assert o.seconds < deadline_s and ("503" in o.error or "worker" in o.error), (i, o)
            failed += 1
    return ok, failed


def _steps(health: dict) -> int:
    """Engine steps a decode host ran: a bound on the tokens any one of its streams got from them."""
    return health["decode_steps_total"] + health["prefill_steps_total"]


# Two streams of this (and their prompts) fit one decode host's 256 blocks, and tiny-qwen2's 2,048
# positions: a stream long enough for a fault to land in while it runs at a fast CPU's pace.
LINK_TOKENS = 1536
# A /health read and the freeze after it within this: even a decode step of 0.1 ms leaves every
# stream of the host frozen short of its last token.
FRESH_S = 0.03


def _freeze_mid_stream(c: PDCluster, since: dict[str, int], seen: dict, poll: httpx.Client) -> str | None:
    """Freeze (SIGSTOP) a decode host whose every stream is under way and none past half of
    LINK_TOKENS, and name it; None if no host is. Since `since` (its steps before the load) the host
    ran at most LINK_TOKENS / 2 steps (no stream of it can be near its end), and its running
    streams are the ones it ran 16 steps ago (`seen`: the count and the step it was first read at;
    none can have ended, so none joined: each has sent tokens, and cutting it off is a migration,
    not a retry). Read from a /health answered at most FRESH_S before the freeze: the test process
    runs short of CPU under streaming load, and a reading it got late is not where the streams are
    (one read at 323 steps had finished 768 before the link went down)."""
    for name in since:
        t0 = time.monotonic()
        h = poll.get(c.procs[name].url + "/health").json()
        steps = _steps(h)
        running, first = seen.get(name, (None, 0))
        if h["running"] != running:
            seen[name] = (h["running"], steps)
        elif h["running"] and steps - first >= 16 and steps - since[name] <= LINK_TOKENS // 2:
            c.net.pause(c.procs[name], True)
            if time.monotonic() - t0 <= FRESH_S:
                return name
            c.net.pause(c.procs[name], False)
    return None


def test_decode_host_link_down_mid_stream_is_migrated(cluster):
    down: dict = {}

    def fault(name: str) -> None:  # the host is frozen: its link goes down, then it runs on, cut off
        down["name"] = name
        down["at"] = time.monotonic()
        try:
            cluster.net.link(cluster.host(name), up=False)
        finally:
            cluster.net.pause(cluster.procs[name], False)

    since = {n: _steps(cluster.health(n)) for n in ROLES if n.startswith("decode")}
    seen: dict[str, tuple[int, int]] = {}
    try:
        with httpx.Client(timeout=5) as poll:
            outs = cluster.load(
                [prompt(i) for i in range(20, 22)],
                LINK_TOKENS,
                fault,
                fault_after=0,
                watch=lambda: _freeze_mid_stream(cluster, since, seen, poll),
            )
    finally:
        if "name" in down:
            cluster.net.link(cluster.host(down["name"]), up=True)
    ok, failed = _check(outs, 20, 60, LINK_TOKENS)
    assert failed == 0
    assert cluster.workers()[down["name"]]["migrations"] >= 1
    cluster.wait_healthy(set(ROLES))
    leaked = cluster.leaked_blocks()
    record(
        "a decode host's link down mid-stream (its streams migrate)",
        ok,
        failed,
        recovery_s(outs, down["at"]),
        leaked,
    )
    assert leaked == 0
    # A migrated request is one trace: the router's attempts on both decode hosts, its migration,
    # and the new decode host's prefill (by a prefill host, its KV transfer) and decode.
    check_migrated_trace(cluster, down["name"], down["at"])


def test_restarted_worker_loses_its_stale_index_entries_then_rebuilds(cluster):
    killed: dict = {}

    def fault(name: str) -> None:
        killed["name"] = name
        killed["blocks"] = cluster.workers()[name]["kv_index_blocks"]
        cluster.procs[name].kill()
        killed["at"] = time.monotonic()

    outs = cluster.load(
        [prompt(i) for i in range(30, 34)],
        FAULT_TOKENS,
        fault,
        watch=lambda: _busy(cluster, indexed=True),
    )
    ok, failed = _check(outs, 30, 60, FAULT_TOKENS)
    assert failed == 0
    name = killed["name"]
    assert killed["blocks"] > 0
    # The dead process's blocks are still indexed (nothing told the router otherwise) ...
    assert cluster.workers()[name]["kv_index_blocks"] > 0
    cluster.start_worker(name).wait_ready(timeout=120)
    t0 = time.monotonic()
    cluster.wait_healthy({name})
    # ... until the router sees the new process: its entries go before it serves anything.
    wait_until(
        lambda: cluster.workers()[name]["kv_index_blocks"] == 0,
        10,
        "the restarted worker's stale entries dropped",
    )
    dropped_s = time.monotonic() - t0
    # It rebuilds from what the new process holds (snapshot, then events).
    for i in range(40, 48):
        before = _requests(cluster)
        r = httpx.post(
            cluster.router.url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": prompt(i, 100), "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        if _requests(cluster)[name] > before[name]:
            break
    else:
        raise AssertionError(f"no request went to the restarted {name}")
    wait_until(
        lambda: cluster.workers()[name]["kv_index_blocks"] == cluster.health(name)["prefix_cache_blocks"] > 0,
        20,
        "the index to rebuild the restarted worker's blocks",
    )
    leaked = cluster.leaked_blocks()
    record(
        "a decode host killed mid-stream, then restarted",
        ok,
        failed,
        recovery_s(outs, killed["at"]),
        leaked,
        f"its stale KV-index entries gone {dropped_s:.1f} s after it was up",
    )
    assert leaked == 0


def _mid_transfer(c: PDCluster, timeout: float = 10.0) -> bool:
    """Wait until the slow prefill host is writing a job's KV (a job in flight and bytes sent since
    the call); False when none was seen within `timeout` (the fault then meets its next jobs)."""
    sent = c.health(SLOW_PREFILL)["kv_send_bytes_total"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = c.health(SLOW_PREFILL)
        if h.get("kv_prefill_jobs_active", 0) > 0 and h["kv_send_bytes_total"] > sent:
            return True
        time.sleep(0.01)
    return False


def _long_prompts(first: int, n: int) -> list[list[int]]:
    return [prompt(i, 400) for i in range(first, first + n)]


def test_prefill_host_link_down_mid_transfer(cluster):
    cut: dict = {}

    def fault() -> None:
        caught = _mid_transfer(cluster)
        cluster.net.link(cluster.host(SLOW_PREFILL), up=False)
        cut.update(name=SLOW_PREFILL, caught=caught, at=time.monotonic())

    t = threading.Thread(target=fault)
    prompts = _long_prompts(50, 8)
    dec0 = [cluster.health(n) for n in ("decode-a", "decode-b")]
    try:
        t.start()
        outs = cluster.load(prompts, 48)
        t.join()
    finally:
        t.join()
        if "name" in cut:
            cluster.net.link(cluster.host(cut["name"]), up=True)
    for i, o in enumerate(outs):
        if o.error is None:
            assert o.text == _want_long(50 + i), (i, o)
    ok = sum(o.error is None for o in outs)
    failed = len(outs) - ok
    assert all(o.seconds < 60 for o in outs) and failed == 0, outs
    cluster.wait_healthy(set(ROLES))
    leaked = cluster.leaked_blocks()
    dec = [cluster.health(n) for n in ("decode-a", "decode-b")]
    delta = {
        k: sum(b[k] - a[k] for a, b in zip(dec0, dec))
        for k in ("kv_transfers_failed_total", "kv_local_prefill_fallbacks_total")
    }
    record(
        "a prefill host's link down while it writes a job's KV",
        ok,
        failed,
        recovery_s(outs, cut["at"]),
        leaked,
        f"caught mid-transfer: {cut['caught']}; transfers failed {delta['kv_transfers_failed_total']}, "
        f"local prefills {delta['kv_local_prefill_fallbacks_total']} (disagg.transfer_timeout_s 6)",
    )
    assert leaked == 0
    if cut["caught"]:  # the cut met a transfer: the decode side failed it (then retried or prefilled)
        assert delta["kv_transfers_failed_total"] > 0, delta


@functools.lru_cache(maxsize=None)
def _want_long(i: int) -> str:
    from pdserve import SamplingParams

    return (
        _offline()
        .generate(prompt(i, 400), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
        .text
    )


def test_prefill_stopped_then_resumed(cluster):
    # The decode workers skip a prefill peer that failed (the cut above) for disagg.peer_retry_s:
    # let prefill-b back in first, or the stop may meet no transfer.
    time.sleep(CONFIG["disagg"]["peer_retry_s"])
    stopped: dict = {}

    def fault() -> None:
        name, caught = SLOW_PREFILL, _mid_transfer(cluster)
        cluster.net.pause(cluster.procs[name], True)
        stopped.update(name=name, caught=caught, at=time.monotonic())
        time.sleep(10)  # longer than every transfer deadline
        cluster.net.pause(cluster.procs[name], False)
        stopped["resumed"] = True

    t = threading.Thread(target=fault)
    try:
        t.start()
        outs = cluster.load(_long_prompts(60, 8), 48)
        t.join()
    finally:
        t.join()
        if "name" in stopped and "resumed" not in stopped:
            cluster.net.pause(cluster.procs[stopped["name"]], False)
    for i, o in enumerate(outs):
        assert o.error is None and o.text == _want_long(60 + i), (i, o)
    cluster.wait_healthy(set(ROLES))
    leaked = cluster.leaked_blocks()
    record(
        "a prefill host stopped (SIGSTOP) mid-transfer for 10 s, then resumed",
        len(outs),
        0,
        recovery_s(outs, stopped["at"]),
        leaked,
        f"caught mid-transfer: {stopped['caught']}",
    )
    assert leaked == 0


def test_one_router_replica_loses_a_decode_host_the_other_still_reaches(cluster):
    ra, victim = cluster.host("router"), "decode-a"
    cut: dict = {}

    def fault() -> None:
        cluster.net.cut(ra, cluster.host(victim))
        cut["at"] = time.monotonic()

    try:
        outs = cluster.load(
            [prompt(i) for i in range(80, 88)], MAX_TOKENS, fault, routers=("router", "router-b")
        )
        # During the cut: router-a has given up on decode-a, router-b still routes to it.
        wait_until(
            lambda: not cluster.workers("router")[victim]["healthy"], 15, "router-a to see decode-a down"
        )
        assert cluster.workers("router-b")[victim]["healthy"]
        before = cluster.workers("router-b")[victim]["requests"]
        got = [cluster.stream(prompt(i), 8, router="router-b") for i in range(90, 92)]
        assert all(o.error is None and o.text == want(i, 8) for i, o in zip(range(90, 92), got)), got
        assert cluster.workers("router-b")[victim]["requests"] > before
    finally:
        cluster.net.cut(ra, cluster.host(victim), cut=False)
    ok, failed = _check(outs, 80, 60)
    assert failed == 0
    cluster.wait_healthy(set(ROLES))
    leaked = cluster.leaked_blocks()
    record(
        "one router replica partitioned from a decode host, the other still reaching it",
        ok,
        failed,
        recovery_s(outs, cut["at"]),
        leaked,
        "router-b kept routing to it",
    )
    assert leaked == 0


SLOW_BITS = 8_000_000


def _slow_link_load(cluster, host: str, first: int, routers=("router",), headers=None) -> tuple[int, dict]:
    """Six long prompts streamed while `host`'s link is capped at 8 Mbit/s (their KV, ~1.2 MB, takes
    over a second on it): each ends with the fault-free output and no decode worker failed a
    transfer or fell back to a local prefill (nothing timed out that should not). Returns the KV
    blocks leaked and the decode side's figures."""
    try:
        cluster.net.shape(cluster.host(host), SLOW_BITS)
    except ShapingUnavailable as e:
        pytest.skip(str(e))
    try:
        dec0 = [cluster.health(n) for n in ("decode-a", "decode-b")]
        sent0, mark = cluster.health(host)["kv_send_bytes_total"], cluster.log_sizes()
        outs = cluster.load(_long_prompts(first, 6), 48, routers=routers, headers=headers)
        for i, o in enumerate(outs, first):
            assert o.error is None and o.text == _want_long(i), (i, o)
        sent = cluster.health(host)["kv_send_bytes_total"] - sent0
        dec1 = [cluster.health(n) for n in ("decode-a", "decode-b")]
    finally:
        cluster.net.shape(cluster.host(host), None)
    d = {
        k: sum(b[k] - a[k] for a, b in zip(dec0, dec1))
        for k in (
            "kv_transfers_failed_total",
            "kv_local_prefill_fallbacks_total",
            "kv_transfers_completed_total",
            "kv_transfer_seconds_total",
        )
    }
    assert d["kv_transfers_failed_total"] == 0 and d["kv_local_prefill_fallbacks_total"] == 0, (
        d,
        cluster.warnings_since(mark),
    )
    assert d["kv_transfers_completed_total"] >= 6 and sent > 0, (d, sent)
    return cluster.leaked_blocks(), {
        "kv_bytes": sent,
        "job_s": d["kv_transfer_seconds_total"] / d["kv_transfers_completed_total"],
    }


def test_slow_link_layerwise(cluster):
    """prefill-a's link at 8 Mbit/s (prefill-b drained), the default layer-wise writes: nothing
    times out. (Whether layer-wise writes beat writing after the forward is measured on the real
    model by benchmarks/slow_link.py: with this 2-layer model the link alone sets both.)"""
    ws = cluster.workers()
    assert (
        httpx.post(
            f"{cluster.router.url}/admin/workers/{ws['prefill-b']['id']}/drain",
            timeout=5,
            headers={"Authorization": f"Bearer {ADMIN}"},
        ).status_code
        == 200
    )
    leaked, f = _slow_link_load(cluster, "prefill-a", 70)
    record(
        "a slow link: a prefill host at 8 Mbit/s, layer-wise writes",
        6,
        0,
        None,
        leaked,
        f"{f['kv_bytes'] / 1e6:.1f} MB of KV; decode-side job {f['job_s']:.2f} s mean; no transfer failed",
    )
    assert leaked == 0


def test_slow_link_after_the_forward(cluster):
    """Drains prefill-b's old process for good: prefill-b restarts with `transfer.layerwise: false`
    (every layer written after the forward; no bandwidth cap) and its link at 8 Mbit/s; the six
    requests go straight to the decode workers naming it as their prefill peer (the headers the
    router sends: the router keeps prefill-b drained). Nothing times out."""
    cluster.procs[SLOW_PREFILL].stop(grace=10)
    cluster.start_worker(SLOW_PREFILL, transfer={"layerwise": False}).wait_ready(timeout=120)
    peer = cluster.health(SLOW_PREFILL)["kv_endpoint"]
    headers = {PREFILL_HEADER: peer, INTERNAL_TOKEN_HEADER: TOKEN}
    leaked, f = _slow_link_load(cluster, SLOW_PREFILL, 100, routers=("decode-a", "decode-b"), headers=headers)
    assert cluster.health(SLOW_PREFILL)["kv_send_bytes_total"] > 0  # the restarted prefill-b did the work
    record(
        "a slow link: a prefill host at 8 Mbit/s, writes after the forward",
        6,
        0,
        None,
        leaked,
        f"{f['kv_bytes'] / 1e6:.1f} MB of KV; decode-side job {f['job_s']:.2f} s mean; no transfer failed",
    )
    assert leaked == 0


def test_the_redis_tier_is_shared_across_hosts(cluster):
    """After the module's traffic (far more prompt blocks than a 256-block pool holds), blocks that
    workers on several hosts evicted sit in the one Redis. (Hosts cut off by the faults above saw
    Redis errors meanwhile: counted, printed. Restores from Redis are checked for parity in
    tests/cache; here they are counted.)"""
    if "redis" not in cluster.procs:
        pytest.skip("redis-server is not installed")
    import redis

    stats = {n: cluster.health(n) for n in ROLES}
    writers = [n for n, h in stats.items() if h.get("tier_remote_bytes_written_total", 0) > 0]
    assert len(writers) >= 2, {n: h.get("tier_remote_bytes_written_total") for n, h in stats.items()}
    assert redis.Redis.from_url(cluster.redis_url).dbsize() > 0
    hits = sum(h.get("tier_remote_hits_total", 0) for h in stats.values())
    errors = {n: h.get("tier_remote_errors_total", 0) for n, h in stats.items()}
    print(f"REDIS_TIER writers={writers} remote_hits={hits} errors={errors}")
