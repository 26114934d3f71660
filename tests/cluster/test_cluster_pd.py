"""PD across hosts (network namespaces): the default deployment over real links, then faults under
streaming load. Each fault asserts that every request completes with the fault-free greedy output
or fails with a clear error within its deadline, and that every KV pool returns to its start."""
from __future__ import annotations

import functools
import threading
import time

import httpx
import pytest
from cluster.cluster_hosts import ShapingUnavailable, unavailable, wait_until
from cluster.pd_cluster import MODEL, ROLES, SLOW_PREFILL, PDCluster, prompt

pytestmark = pytest.mark.slow
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    c = PDCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.close()


@functools.lru_cache(maxsize=None)
def _offline():
    from pdserve import LLM
    return LLM(model=MODEL)


@functools.lru_cache(maxsize=None)
def want(i: int, max_tokens: int = MAX_TOKENS) -> str:
    """The fault-free greedy text of prompt(i): the offline engine's."""
    from pdserve import SamplingParams
    return _offline().generate(prompt(i), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].text


def _requests(c: PDCluster) -> dict[str, int]:
    return {n: w["requests"] for n, w in c.workers().items()}


def test_default_deployment_across_hosts(cluster):
    ws = cluster.workers()
    assert sorted(ws) == sorted(ROLES), ws
    for name, w in ws.items():       # each registered itself from its own host, at its own address
        assert w["role"] == ROLES[name] and w["healthy"]
        assert w["url"] == cluster.host(name).url(8000)
    other = cluster.workers("router-b")     # ... with both router replicas
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
    wait_until(lambda: all(w["kv_index_blocks"] > 0 for n, w in cluster.workers().items() if n.startswith("decode")),
               30, "the router's KV index to learn both decode workers' blocks")
    cluster.idle_pools()


def test_follow_up_goes_to_the_decode_worker_holding_its_prefix(cluster):
    placed = {}
    for i in range(10, 14):
        before = _requests(cluster)
        r = httpx.post(cluster.router.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt(i, 160), "max_tokens": 2})
        assert r.status_code == 200, r.text
        [placed[i]] = [n for n, k in _requests(cluster).items() if n.startswith("decode") and k > before[n]]
    wait_until(lambda: all(cluster.workers()[n]["kv_index_blocks"] >= 10 for n in placed.values()), 30,
               "the index to hold the prompts' blocks")
    for i in range(10, 14):
        before = _requests(cluster)
        r = httpx.post(cluster.router.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt(i, 160) + [7, 8, 9], "max_tokens": 2})
        assert r.status_code == 200, r.text
        got = [n for n, k in _requests(cluster).items() if n.startswith("decode") and k > before[n]]
        assert got == [placed[i]], (i, placed, got)
    cluster.idle_pools()


def _busy_decode(c: PDCluster) -> str:
    """A decode host with streams in flight (the one with most)."""
    ws = {n: w for n, w in c.workers().items() if n.startswith("decode")}
    name = max(ws, key=lambda n: ws[n]["load"]["in_flight"])
    assert ws[name]["load"]["in_flight"] > 0, ws
    return name


def _check(outs, first: int, deadline_s: float) -> tuple[int, int]:
    """Every request has the fault-free text, or a clear error within its deadline; (ok, failed)."""
    ok = failed = 0
    for i, o in enumerate(outs, first):
        if o.error is None:
            assert o.text == want(i), (i, o)
            ok += 1
        else:
            assert o.seconds < deadline_s and ("503" in o.error or "worker" in o.error), (i, o)
            failed += 1
    return ok, failed


def test_decode_host_link_down_mid_stream_is_migrated(cluster):
    down: dict = {}

    def fault() -> None:
        down["name"] = _busy_decode(cluster)
        down["at"] = time.monotonic()
        cluster.net.link(cluster.host(down["name"]), up=False)

    try:
        outs = cluster.load([prompt(i) for i in range(20, 26)], MAX_TOKENS, fault, fault_after=8)
        recovered = max(o.seconds for o in outs)
    finally:
        if "name" in down:
            cluster.net.link(cluster.host(down["name"]), up=True)
    ok, failed = _check(outs, 20, 60)
    assert failed == 0
    assert cluster.workers()[down["name"]]["migrations"] >= 1
    cluster.wait_healthy(set(ROLES))
    cluster.idle_pools()
    print(f"FAULT decode_link_down ok={ok} failed={failed} slowest_request_s={recovered:.1f} "
          f"longest_stall_s={max(o.max_gap for o in outs):.1f}")


def test_restarted_worker_loses_its_stale_index_entries_then_rebuilds(cluster):
    killed: dict = {}

    def fault() -> None:
        killed["name"] = name = _busy_decode(cluster)
        killed["blocks"] = cluster.workers()[name]["kv_index_blocks"]
        cluster.procs[name].kill()

    outs = cluster.load([prompt(i) for i in range(30, 36)], MAX_TOKENS, fault)
    ok, failed = _check(outs, 30, 60)
    assert failed == 0
    name = killed["name"]
    assert killed["blocks"] > 0
    # The dead process's blocks are still indexed (nothing told the router otherwise) ...
    assert cluster.workers()[name]["kv_index_blocks"] > 0
    cluster.start_worker(name).wait_ready(timeout=120)
    t0 = time.monotonic()
    cluster.wait_healthy({name})
    # ... until the router sees the new process: its entries go before it serves anything.
    wait_until(lambda: cluster.workers()[name]["kv_index_blocks"] == 0, 10, "the restarted worker's stale entries dropped")
    dropped_s = time.monotonic() - t0
    # It rebuilds from what the new process holds (snapshot, then events).
    for i in range(40, 48):
        before = _requests(cluster)
        r = httpx.post(cluster.router.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt(i, 100), "max_tokens": 2})
        assert r.status_code == 200, r.text
        if _requests(cluster)[name] > before[name]:
            break
    else:
        raise AssertionError(f"no request went to the restarted {name}")
    wait_until(lambda: cluster.workers()[name]["kv_index_blocks"] == cluster.health(name)["prefix_cache_blocks"] > 0,
               20, "the index to rebuild the restarted worker's blocks")
    cluster.idle_pools()
    print(f"FAULT decode_restart ok={ok} failed={failed} stale_entries_dropped_s_after_ready={dropped_s:.1f} "
          f"longest_stall_s={max(o.max_gap for o in outs):.1f}")


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
    slowest = max(o.seconds for o in outs)
    cluster.wait_healthy(set(ROLES))
    cluster.idle_pools()
    dec = [cluster.health(n) for n in ("decode-a", "decode-b")]
    delta = {k: sum(b[k] - a[k] for a, b in zip(dec0, dec)) for k in ("kv_transfers_failed_total",
                                                                       "kv_local_prefill_fallbacks_total")}
    if cut["caught"]:       # the cut met a transfer: the decode side failed it (then retried or prefilled)
        assert delta["kv_transfers_failed_total"] > 0, delta
    print(f"FAULT prefill_link_down ok={ok} failed={failed} slowest_request_s={slowest:.1f} "
          f"caught_in_flight={cut['caught']} transfers_failed={delta['kv_transfers_failed_total']} "
          f"local_fallbacks={delta['kv_local_prefill_fallbacks_total']} longest_stall_s={max(o.max_gap for o in outs):.1f}")


@functools.lru_cache(maxsize=None)
def _want_long(i: int) -> str:
    from pdserve import SamplingParams
    return _offline().generate(prompt(i, 400), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0].text


def test_prefill_stopped_then_resumed(cluster):
    stopped: dict = {}

    def fault() -> None:
        name, caught = SLOW_PREFILL, _mid_transfer(cluster)
        cluster.net.pause(cluster.procs[name], True)
        stopped.update(name=name, caught=caught)
        time.sleep(10)          # longer than every transfer deadline
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
    slowest = max(o.seconds for o in outs)
    cluster.wait_healthy(set(ROLES))
    cluster.idle_pools()
    print(f"FAULT prefill_sigstop ok={len(outs)} failed=0 slowest_request_s={slowest:.1f} caught_in_flight={stopped['caught']} "
          f"longest_stall_s={max(o.max_gap for o in outs):.1f}")


def test_one_router_replica_loses_a_decode_host_the_other_still_reaches(cluster):
    ra, victim = cluster.host("router"), "decode-a"
    cut: dict = {}

    def fault() -> None:
        cluster.net.cut(ra, cluster.host(victim))
        cut["at"] = time.monotonic()

    try:
        outs = cluster.load([prompt(i) for i in range(80, 88)], MAX_TOKENS, fault, routers=("router", "router-b"))
        # During the cut: router-a has given up on decode-a, router-b still routes to it.
        wait_until(lambda: not cluster.workers("router")[victim]["healthy"], 15, "router-a to see decode-a down")
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
    cluster.idle_pools()
    print(f"FAULT router_worker_partition ok={ok} failed={failed} longest_stall_s={max(o.max_gap for o in outs):.1f}")


def _send_figures(c: PDCluster, name: str) -> dict:
    h = c.health(name)
    return {k: h[k] for k in ("kv_send_steps_total", "kv_send_tail_lag_seconds_total", "kv_send_bytes_total",
                              "kv_send_seconds_total")}


def test_slow_link_nothing_times_out(cluster):
    """Last in the module: drains prefill-b. prefill-a's link is slowed to 8 Mbit/s (6 prompts' KV,
    ~1.2 MB, take over a second on it): nothing times out that should not and the outputs are the
    fault-free ones. Printed: the prefill's wait for its writes per step (tail lag; the kernel's
    socket buffer takes the bytes, the link sets when they land) and the decode side's mean job
    time. Whether layer-wise writes beat sending after the forward is not shown here: with this
    2-layer model the link, not the compute, sets both (benchmarks/kv_transfer.py measures the
    overlap on the real model)."""
    ws = cluster.workers()
    assert httpx.post(f"{cluster.router.url}/admin/workers/{ws['prefill-b']['id']}/drain", timeout=5).status_code == 200
    host = cluster.host("prefill-a")
    try:
        cluster.net.shape(host, 8_000_000)
    except ShapingUnavailable as e:
        pytest.skip(str(e))
    try:
        dec0 = [cluster.health(n) for n in ("decode-a", "decode-b")]
        f0 = _send_figures(cluster, "prefill-a")
        outs = cluster.load(_long_prompts(70, 6), 48)
        for i, o in enumerate(outs, 70):
            assert o.error is None and o.text == _want_long(i), (i, o)
        f1 = _send_figures(cluster, "prefill-a")
        dec1 = [cluster.health(n) for n in ("decode-a", "decode-b")]
    finally:
        cluster.net.shape(host, None)
    for a, b in zip(dec0, dec1):
        for key in ("kv_transfers_failed_total", "kv_local_prefill_fallbacks_total"):
            assert b[key] == a[key], key          # nothing timed out on the slow link
    jobs = sum(b["kv_transfers_completed_total"] - a["kv_transfers_completed_total"] for a, b in zip(dec0, dec1))
    job_s = sum(b["kv_transfer_seconds_total"] - a["kv_transfer_seconds_total"] for a, b in zip(dec0, dec1))
    steps = f1["kv_send_steps_total"] - f0["kv_send_steps_total"]
    assert steps > 0 and jobs >= 6
    tail = (f1["kv_send_tail_lag_seconds_total"] - f0["kv_send_tail_lag_seconds_total"]) / steps
    cluster.idle_pools()
    print(f"SLOW_LINK 8Mbit ok={len(outs)} failed=0 kv_bytes={f1['kv_send_bytes_total'] - f0['kv_send_bytes_total']} "
          f"tail_lag_ms_per_step={tail * 1e3:.1f} decode_mean_job_s={job_s / jobs:.2f}")


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
