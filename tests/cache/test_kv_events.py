"""KV events over real ZMQ sockets: publisher -> subscriber -> index, snapshots, gaps, matching."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.kv_events import KVEventPublisher, KVEventSubscriber, KVIndex
from pdserve.cache.prefix_cache import PrefixCache, prompt_hashes
from pdserve.protocol import KVEvent, KVSnapshot

WAIT = 10.0


def _ev(worker: str, seq: int, kind: str, hashes: list[str], tier: str = "device") -> KVEvent:
    return KVEvent(type=kind, block_hashes=hashes, tier=tier, worker_id=worker, seq=seq, ts=0.0)


def _pump(sub: KVEventSubscriber, index: KVIndex, until, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for ev in sub.poll(0.05):
            index.apply(ev)


def _connected(pub: KVEventPublisher, sub: KVEventSubscriber) -> None:
    """PUB drops what it sends before the subscription reaches it: probe until one arrives."""
    deadline = time.monotonic() + WAIT
    while True:
        pub.stored(["probe"], None, "host")
        if sub.poll(0.05):
            break
        assert time.monotonic() < deadline, "the subscription never arrived"
    pub.removed(["probe"], "host")
    while not any(e.type == "removed" and e.block_hashes == ["probe"] for e in sub.poll(0.05)):
        assert time.monotonic() < deadline, "the probe's removal never arrived"


@pytest.fixture(params=["tcp", "ipc"])
def endpoints(request, tmp_path):
    if request.param == "tcp":
        return "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/snapshot"


@pytest.fixture
def pubsub(endpoints):
    pub = KVEventPublisher(endpoints[0], "worker-1", endpoints[1])
    sub = KVEventSubscriber(pub.endpoint, pub.snapshot_endpoint)
    yield pub, sub
    sub.close()
    pub.close()


def test_incremental_index_equals_snapshot_rebuild(pubsub):
    pub, sub = pubsub
    cache = PrefixCache(4, listener=pub.on_prefix_cache)
    pool = BlockPool(6, cache)
    _connected(pub, sub)
    incremental = KVIndex()
    incremental.apply_snapshot(sub.snapshot())
    assert "worker-1" not in incremental.needs_snapshot

    a = prompt_hashes(list(range(12)), 4)
    blocks = pool.allocate(3)
    for i, (h, b) in enumerate(zip(a, blocks)):
        cache.insert(h, a[i - 1] if i else None, b)
    pub.on_tier("stored", a[:2], "host")
    pub.on_tier("stored", [a[0]], "disk")
    pool.free(blocks)
    pool.allocate(4)  # 3 free blocks, then the LRU leaf a[2] is evicted
    pub.on_tier("removed", [a[1]], "host")
    _pump(sub, incremental, lambda: incremental.last_seq.get("worker-1") == pub.seq, "the events")
    assert not incremental.needs_snapshot

    rebuilt = KVIndex()
    rebuilt.apply_snapshot(sub.snapshot())
    expected = {a[0].hex(): {"device", "host", "disk"}, a[1].hex(): {"device"}}
    assert incremental.worker_blocks("worker-1") == rebuilt.worker_blocks("worker-1") == expected
    assert incremental.match(a) == rebuilt.match(a) == {"worker-1": (2, "device")}
    assert pub.stats()["kv_events_dropped_total"] == 0 and pub.stats()["kv_snapshots_served_total"] == 2


def test_a_chain_of_inserts_is_one_event_in_order(pubsub):
    pub, sub = pubsub
    _connected(pub, sub)
    hs = [bytes([i]) * 16 for i in range(4)]
    pub.stored(hs[:1], None)
    pub.stored(hs[1:2], hs[0])
    pub.stored(hs[2:3], hs[1])
    pub.removed(hs[2:3])
    pub.stored(hs[3:4], hs[1])  # parent is not the last one sent: a new event
    got: list[KVEvent] = []
    deadline = time.monotonic() + WAIT
    while sum(len(e.block_hashes) for e in got) < 5:
        assert time.monotonic() < deadline
        got += sub.poll(0.05)
    # Coalescing depends on how fast the socket thread drains; the sequence of effects does not.
    flat = [(e.type, h) for e in got for h in e.block_hashes]
    assert flat == [
        ("stored", hs[0].hex()),
        ("stored", hs[1].hex()),
        ("stored", hs[2].hex()),
        ("removed", hs[2].hex()),
        ("stored", hs[3].hex()),
    ]
    assert [e.seq for e in got] == list(range(got[0].seq, got[0].seq + len(got)))
    assert got[0].parent_hash is None and got[-1].parent_hash == hs[1].hex()


def test_subscriber_update_resyncs_after_lost_events(endpoints):
    # max_pending=0: every event is dropped before the socket, as on a full queue.
    pub = KVEventPublisher(endpoints[0], "w", endpoints[1], max_pending=0)
    sub = KVEventSubscriber(pub.endpoint, pub.snapshot_endpoint)
    try:
        index = KVIndex()
        pub.stored(["aa", "bb"], None, "device")
        pub.removed(["aa"], "device")
        assert pub.stats()["kv_events_dropped_total"] == 2
        sub.update(index)  # no state yet: takes a snapshot
        assert index.worker_blocks("w") == {"bb": {"device"}} and index.last_seq["w"] == pub.seq
    finally:
        sub.close()
        pub.close()


def test_index_ignores_stale_events_and_flags_gaps():
    index = KVIndex()
    index.apply_snapshot(KVSnapshot(worker_id="w", seq=10, blocks={"aa": ["device"]}))
    assert not index.apply(_ev("w", 9, "removed", ["aa"]))  # already in the snapshot
    assert index.apply(_ev("w", 11, "stored", ["bb"], "disk"))
    assert not index.needs_snapshot
    assert index.apply(_ev("w", 14, "stored", ["cc"]))
    assert index.needs_snapshot == {"w"}
    assert index.apply(_ev("x", 5, "stored", ["aa"]))  # never snapshotted
    assert index.needs_snapshot == {"w", "x"}
    index.remove_worker("x")
    assert index.worker_blocks("x") == {} and index.needs_snapshot == {"w"}
    assert index.worker_blocks("w") == {"aa": {"device"}, "bb": {"disk"}, "cc": {"device"}}


def test_match_counts_leading_blocks_per_worker_and_the_bounding_tier():
    index = KVIndex()
    index.apply_snapshot(
        KVSnapshot(worker_id="a", seq=1, blocks={"h0": ["device"], "h1": ["device", "disk"], "h2": ["host"]})
    )
    index.apply_snapshot(KVSnapshot(worker_id="b", seq=1, blocks={"h0": ["disk"], "h1": ["device"]}))
    index.apply_snapshot(KVSnapshot(worker_id="c", seq=1, blocks={"h1": ["device"], "h2": ["device"]}))
    assert index.match(["h0", "h1", "h2", "h3"]) == {"a": (3, "host"), "b": (2, "disk")}
    assert index.match(["h0", "h1"]) == {"a": (2, "device"), "b": (2, "disk")}
    assert index.match([b"\x01" * 16]) == {} and index.match([]) == {}
    index.apply(_ev("a", 2, "removed", ["h1"], "device"))
    assert index.match(["h0", "h1"])["a"] == (2, "disk")


def test_seq_keeps_growing_across_a_restart_and_tiers_are_checked(endpoints):
    first = KVEventPublisher(endpoints[0], "w")
    first.stored(["aa"])
    with pytest.raises(ValueError):
        first.stored(["bb"], None, "ssd")
    last = first.seq
    first.close()
    second = KVEventPublisher(endpoints[0], "w")
    try:
        assert second.seq > last
    finally:
        second.close()


def test_snapshot_timeout_and_malformed_batches(tmp_path):
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.PUB)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(f"ipc://{tmp_path}/rogue")
    silent = ctx.socket(zmq.ROUTER)  # accepts requests, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"ipc://{tmp_path}/silent")
    sub = KVEventSubscriber(f"ipc://{tmp_path}/rogue", f"ipc://{tmp_path}/silent")
    try:
        with pytest.raises(TimeoutError, match="within 0.2s"):  # a silent worker costs the timeout given
            sub.snapshot(timeout=0.2)
        good = msgpack.packb({"worker_id": "w", "events": [_ev("w", 1, "stored", ["aa"]).model_dump()]})
        deadline = time.monotonic() + WAIT
        events: list[KVEvent] = []
        while not events:
            assert time.monotonic() < deadline
            rogue.send_multipart([b"kv", b"\xc1 not msgpack"])
            rogue.send_multipart([b"kv", msgpack.packb({"worker_id": "w", "events": [{"type": "bogus"}]})])
            rogue.send_multipart([b"kv", good])
            events = sub.poll(0.05)
        assert events[0].block_hashes == ["aa"] and sub.malformed >= 2
    finally:
        sub.close()
        rogue.close()
        silent.close()


def _reference_match(index, hashes):
    """The definition, block by block: leading blocks held in any tier; the slowest fastest tier."""
    from pdserve.cache.kv_index import TIER_RANK, hash_hex
    from pdserve.protocol import KV_TIERS

    out = {}
    for w in index.workers:
        n, worst = 0, 0
        for h in map(hash_hex, hashes):
            tiers = index._blocks.get(h, {}).get(w)
            if not tiers:
                break
            n += 1
            worst = max(worst, min(TIER_RANK[t] for t in tiers))
        if n:
            out[w] = (n, KV_TIERS[worst])
    return out


def test_index_match_equals_its_definition_under_random_events():
    import random

    from pdserve.cache.kv_index import KVIndex
    from pdserve.protocol import KVEvent

    rng = random.Random(0)
    hs = [f"{i:032x}" for i in range(12)]
    for _ in range(300):
        index, seq = KVIndex(), {}
        for _ in range(rng.randint(1, 40)):
            w = f"w{rng.randint(0, 4)}"
            seq[w] = seq.get(w, 0) + 1
            s = rng.randint(0, 11)
            ev = KVEvent(
                type=rng.choice(["stored", "stored", "removed"]),
                block_hashes=hs[s : rng.randint(s, 12)],
                worker_id=w,
                seq=seq[w],
                ts=0,
                tier=rng.choice(["device", "host", "disk", "remote"]),
            )
            index.apply(ev)
            if rng.random() < 0.05:
                index.remove_worker(w)
        q = hs[: rng.randint(0, 12)]
        assert index.match(q) == _reference_match(index, q)


def test_with_the_internal_token_only_its_holders_read_events_and_snapshots(tmp_path):
    """Block hashes are a cache-probing oracle: with a token, a peer without it (plain, with another
    token, or knowing the server's key but not the client's) gets no event and no snapshot, on a
    wildcard bind too; the router's subscriber, which holds it, gets both."""
    from pdserve.cache.kv_events import curve_keys

    pub = KVEventPublisher(
        "tcp://0.0.0.0:*", "w", "tcp://0.0.0.0:*", advertise_host="127.0.0.1", token="tok-1"
    )
    router = KVEventSubscriber(pub.endpoint, pub.snapshot_endpoint, token="tok-1")
    strangers = [
        KVEventSubscriber(pub.endpoint, pub.snapshot_endpoint),
        KVEventSubscriber(pub.endpoint, pub.snapshot_endpoint, token="tok-2"),
    ]
    leaked = zmq.Context.instance().socket(zmq.SUB)  # the server's key leaked; the client's did not
    leaked.setsockopt(zmq.LINGER, 0)
    leaked.setsockopt(zmq.SUBSCRIBE, b"")
    leaked.curve_serverkey = curve_keys("tok-1", b"server")[0]
    leaked.curve_publickey, leaked.curve_secretkey = zmq.curve_keypair()
    leaked.connect(pub.endpoint)
    try:
        _connected(pub, router)
        pub.stored(["secret-prefix"])
        seen: list[KVEvent] = []
        deadline = time.monotonic() + WAIT
        while not any(e.block_hashes == ["secret-prefix"] for e in seen):
            assert time.monotonic() < deadline
            seen += router.poll(0.05)
        assert "secret-prefix" in router.snapshot(timeout=WAIT).blocks
        for s in strangers:
            assert s.poll(1.0) == []
            with pytest.raises(TimeoutError):
                s.snapshot(timeout=1.0)
        assert not leaked.poll(1000) and pub.refused >= 1 and pub.snapshots_served == 1
    finally:
        for s in (router, *strangers):
            s.close()
        leaked.close()
        pub.close()


def test_an_oversized_frame_to_the_snapshot_socket_is_cut_off(endpoints):
    """The snapshot socket takes one short request: a peer sending megabytes is disconnected by
    ZeroMQ before the frame is buffered, and the worker keeps answering real requests."""
    pub = KVEventPublisher(endpoints[0], "worker-1", endpoints[1])
    sub = KVEventSubscriber(pub.endpoint, pub.snapshot_endpoint)
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        assert 0 < pub._snap.getsockopt(zmq.MAXMSGSIZE) <= 4096
        rogue.connect(pub.snapshot_endpoint)
        for _ in range(3):
            rogue.send_multipart([b"", b"x" * (8 << 20)])
        assert sub.snapshot(timeout=WAIT).worker_id == "worker-1"
    finally:
        rogue.close()
        sub.close()
        pub.close()
