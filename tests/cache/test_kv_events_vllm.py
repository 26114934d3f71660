"""KV events in vLLM's wire format over real ZMQ sockets: the codec both ways and in every layout,
frames and topic, AllBlocksCleared first, replay after drops and after a late join with no gap, a
queue overflow resynchronised, and the router's index fed these events matching exactly what it
matches from pdserve's own events for the same cache activity."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.kv_events import KVEventPublisher
from pdserve.cache.kv_events_vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    VLLMEventPublisher,
    VLLMEventSubscriber,
    decode_batch,
    encode_batch,
    hash_key,
)
from pdserve.cache.prefix_cache import PrefixCache, prompt_hashes
from pdserve.config import load_config
from pdserve.config_rules import ConfigError
from pdserve.protocol import KVEvent, KVSnapshot
from pdserve.router.kv_index_feed import IndexFeed

WAIT = 10.0
BS = 4
H = [bytes([i]) * 16 for i in range(8)]


def _batch() -> EventBatch:
    return EventBatch(
        12.5,
        [
            AllBlocksCleared(),
            BlockStored([H[1], H[2]], H[0], list(range(8)), BS, None, "GPU", None),
            BlockStored([7, -3], None, [1, 2, 3, 4, 5, 6, 7, 8], BS, 3, "CPU", "adapter"),
            BlockRemoved([H[2]], "GPU"),
        ],
        0,
    )


@pytest.mark.parametrize("layout", ["vllm", "vllm-array"])
def test_codec_round_trip(layout):
    batch = _batch()
    back = decode_batch(encode_batch(batch, layout))
    if layout == "vllm-array":  # arrays end at `medium`, as the releases that wrote them did
        batch.events[2].lora_name = None  # type: ignore[union-attr]
    assert back == batch


def test_layouts_on_the_wire():
    """Map events tagged under "type" in an array batch (recent vLLM), arrays tagged first (older),
    and a batch that is itself a map: all read alike."""
    ev = msgpack.unpackb(encode_batch(_batch(), "vllm"))
    assert ev[0] == 12.5 and ev[2] == 0
    assert ev[1][0] == {"type": "AllBlocksCleared"}
    assert list(ev[1][1]) == ["type", *BlockStored.__dataclass_fields__]
    assert ev[1][3] == {"type": "BlockRemoved", "block_hashes": [H[2]], "medium": "GPU"}
    arr = msgpack.unpackb(encode_batch(_batch(), "vllm-array"))
    assert arr[1][1] == ["BlockStored", [H[1], H[2]], H[0], list(range(8)), BS, None, "GPU"]
    as_map = msgpack.packb(
        {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [5], "medium": None}]}
    )
    assert decode_batch(as_map) == EventBatch(1.0, [BlockRemoved([5], None)], None)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb("hello"),
        msgpack.packb([1.0, "x"]),
        msgpack.packb([1.0, [["Nope", [1]]]]),
        msgpack.packb([1.0, [["BlockRemoved", "not a list", None]]]),
        msgpack.packb([1.0, [["BlockStored", [b"a"], None, ["t"], 4, None, None]]]),
        msgpack.packb([1.0, [{"block_hashes": [1]}]]),
        msgpack.packb(["now", []]),
    ],
)
def test_malformed_batches_are_refused(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_int_hashes_get_a_stable_key():
    assert hash_key(H[3]) == H[3].hex()
    assert hash_key(-1) == "ffffffffffffffff" and hash_key(255) == "00000000000000ff"


def test_bad_format_is_a_config_error():
    assert load_config().cache.kv_events_format == "pdserve"
    assert load_config(overrides={"cache.kv_events_format": "vllm"}).cache.kv_events_format == "vllm"
    with pytest.raises(ConfigError, match="cache.kv_events_format"):
        load_config(overrides={"cache.kv_events_format": "sglang"})


# ---------------------------------------------------------------------- over sockets


def _publisher(**kw) -> VLLMEventPublisher:
    return VLLMEventPublisher(
        "tcp://127.0.0.1:*", "w", "tcp://127.0.0.1:*", topic="kv@127.0.0.1:8000@tiny", block_size=BS, **kw
    )


PROBE = "ff" * 16  # a block no test stores


def _drain(sub: VLLMEventSubscriber, until, what: str, pub: VLLMEventPublisher | None = None) -> list:
    """Poll until `until(received)`. With `pub`, a quiet poll sends a probe (the removal of a block
    nobody holds): a subscriber learns of lost batches only from a later one, and PUB drops what it
    sends before a subscription arrives."""
    out: list = []
    deadline = time.monotonic() + WAIT
    while not until(out):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        got = sub.poll(0.05)
        out += got
        if not got and pub is not None:
            pub.removed([PROBE], "device")
    return [e for e in out if not (isinstance(e, KVEvent) and e.block_hashes == [PROBE])]


def _caught_up(pub: VLLMEventPublisher, sub: VLLMEventSubscriber) -> bool:
    return pub.stats()["kv_events_pending"] == 0 and sub.last_seq == pub._next_seq - 1


def test_frames_topic_and_cleared_first():
    pub = _publisher()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"kv@")
    raw.connect(pub.endpoint)
    try:
        # The first batch went out before anyone subscribed: the replay socket still has it.
        sub = VLLMEventSubscriber(pub.endpoint, pub.replay_endpoint, "w")
        seqs = sub.replay(0)
        assert [s for s, _ in seqs] == [0]
        assert decode_batch(seqs[0][1]).events == [AllBlocksCleared()]
        deadline = time.monotonic() + WAIT
        while not raw.poll(50):  # PUB drops what it sends before a subscription arrives: probe
            pub.stored([H[7]], None, "host")
            assert time.monotonic() < deadline
        topic, seq, payload = raw.recv_multipart()
        assert topic == b"kv@127.0.0.1:8000@tiny" and len(seq) == 8
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0
        if int.from_bytes(seq, "big") == 0:  # it subscribed in time for the first batch
            assert batch.events == [AllBlocksCleared()]
        sub.close()
    finally:
        raw.close()
        pub.close()


def _not_probe(e) -> bool:
    return isinstance(e, KVEvent) and e.block_hashes != [PROBE]


def test_device_and_tier_events_carry_tokens_parents_and_media():
    pub = _publisher()
    sub = VLLMEventSubscriber(pub.endpoint, pub.replay_endpoint, "w")
    try:
        # The subscription first: PUB drops what it sends before one arrives.
        _drain(sub, lambda o: bool(o), "the subscription", pub)
        cache = PrefixCache(BS, listener=pub.on_prefix_cache)
        pool = BlockPool(8, cache)
        tokens = list(range(100, 112))
        hashes = prompt_hashes(tokens, BS)
        for i, (h, b) in enumerate(zip(hashes, pool.allocate(3))):
            cache.insert(h, hashes[i - 1] if i else None, b, tokens[i * BS : (i + 1) * BS])
        pub.on_tier("stored", [hashes[2], hashes[1]], "host")
        pub.on_tier("stored", [hashes[0]], "remote")
        pub.removed([hashes[2]], "host")
        # The host removal was sent last: once it is in, every event before it is (replayed if lost).
        last = lambda o: any(_not_probe(e) and e.type == "removed" and e.tier == "host" for e in o)  # noqa: E731
        got = _drain(sub, last, "the events", pub)
        stored = [e for e in got if _not_probe(e) and e.type == "stored"]
        # The chain's blocks on the device, in order (one event or several: as the batches fell).
        device = [e for e in stored if e.tier == "device"]
        assert [h for e in device for h in e.block_hashes] == [h.hex() for h in hashes]
        assert [(e.block_hashes, e.parent_hash, e.tier) for e in stored if e.tier == "host"] == [
            ([hashes[2].hex()], hashes[1].hex(), "host"),
            ([hashes[1].hex()], hashes[0].hex(), "host"),
        ]
        # On the wire: the chain's tokens in order, the host copies' own tokens, the media.
        probe = bytes.fromhex(PROBE)
        wire = [ev for _, p in sub.replay(0) for ev in decode_batch(p).events]
        st = [ev for ev in wire if isinstance(ev, BlockStored)]
        gpu = [ev for ev in st if ev.medium == "GPU"]
        assert [t for ev in gpu for t in ev.token_ids] == tokens and gpu[0].parent_block_hash is None
        cpu = [ev for ev in st if ev.medium == "CPU"]
        assert cpu[0].token_ids == tokens[8:12] and cpu[0].block_size == BS
        assert [ev.token_ids for ev in st if ev.medium == "REMOTE"] == [tokens[:4]]
        removed = [ev for ev in wire if isinstance(ev, BlockRemoved) and ev.block_hashes != [probe]]
        assert [ev.medium for ev in removed] == ["CPU"]
    finally:
        sub.close()
        pub.close()


def _expected_hashes(n: int) -> list[str]:
    return [random.Random(i).randbytes(16).hex() for i in range(n)]


def test_dropped_batches_are_replayed_with_no_gap():
    """Tiny queues on both sides and a subscriber that does not read while 400 batches go out: ZMQ
    drops most of them; the subscriber sees the seq gaps, replays, and applies every batch once, in
    order."""
    n = 400
    pub = _publisher(max_batch=1, sndhwm=4)
    sub = VLLMEventSubscriber(pub.endpoint, pub.replay_endpoint, "w", rcvhwm=4)
    try:
        _drain(sub, lambda o: o, "the first batch", pub)
        hashes = _expected_hashes(n)
        for h in hashes:
            pub.stored([h], None, "host")  # max_batch 1: a batch each
        got = _drain(sub, lambda o: _caught_up(pub, sub) and len(o) >= n, "every batch", pub)
        events = [e for e in got if isinstance(e, KVEvent)]
        assert [h for e in events for h in e.block_hashes] == hashes
        assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + len(events)))
        assert sub.gaps == 0 and sub.replays >= 1, (sub.gaps, sub.replays)
        assert not any(isinstance(e, KVSnapshot) for e in got)
    finally:
        sub.close()
        pub.close()


def test_a_late_subscriber_replays_from_the_start():
    pub = _publisher()
    try:
        hashes = _expected_hashes(50)
        for h in hashes:
            pub.stored([h], None, "device")
        deadline = time.monotonic() + WAIT
        while pub.stats()["kv_events_pending"] or pub.published < 51:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sub = VLLMEventSubscriber(pub.endpoint, pub.replay_endpoint, "w")
        got = _drain(sub, lambda o: len(o) >= 51, "the stored blocks", pub)  # the probe: its first live batch
        assert isinstance(got[0], KVSnapshot) and got[0].blocks == {}
        assert [
            h for e in got if isinstance(e, KVEvent) and e.type == "stored" for h in e.block_hashes
        ] == hashes
        assert sub.gaps == 0 and sub.replays == 1
        sub.close()
    finally:
        pub.close()


def test_overflow_republishes_the_state_after_a_clear():
    pub = _publisher(max_pending=3)
    sub = VLLMEventSubscriber(pub.endpoint, pub.replay_endpoint, "w")
    try:
        _drain(sub, lambda o: o, "the first batch", pub)
        hashes = _expected_hashes(40)
        with pub._lock:  # producers now leave the socket thread asleep: the queue overflows
            pub._signaled = True
        for h in hashes:
            pub.stored([h], None, "device")
        pub.removed([hashes[0]], "device")
        with pub._lock:
            pub._signaled = False  # the next event (_drain's probe) wakes it
        got = _drain(sub, lambda o: sum(isinstance(e, KVEvent) for e in o) >= 39, "the resync", pub)
        assert isinstance(got[0], KVSnapshot)
        assert sorted(h for e in got if isinstance(e, KVEvent) for h in e.block_hashes) == sorted(hashes[1:])
        assert pub.dropped > 0
    finally:
        sub.close()
        pub.close()


# ---------------------------------------------------------------------- the router's index


class _Tee:
    """One worker's cache, heard by both publishers: the same activity in both formats."""

    def __init__(self, a: KVEventPublisher, b: VLLMEventPublisher) -> None:
        self.pubs = (a, b)

    def on_prefix_cache(self, *args) -> None:
        for p in self.pubs:
            p.on_prefix_cache(*args)

    def on_tier(self, *args) -> None:
        for p in self.pubs:
            p.on_tier(*args)


def _settled(feed: IndexFeed, states: dict[str, dict]) -> bool:
    with feed.lock:
        return all(feed.index.worker_blocks(w) == s for w, s in states.items())


def test_router_index_from_vllm_events_matches_pdserves():
    rng = random.Random(7)
    own, vllm = IndexFeed(), IndexFeed()
    workers = []
    try:
        for w in ("w0", "w1", "w2"):
            a = KVEventPublisher("tcp://127.0.0.1:*", w, "tcp://127.0.0.1:*")
            b = VLLMEventPublisher(
                "tcp://127.0.0.1:*", w, "tcp://127.0.0.1:*", topic=f"kv@{w}@tiny", block_size=BS
            )
            tee = _Tee(a, b)
            cache = PrefixCache(BS, listener=tee.on_prefix_cache)
            workers.append((w, a, b, tee, cache, BlockPool(24, cache)))
            own.watch(a.endpoint, a.snapshot_endpoint, w, 1)
            vllm.watch(b.endpoint, b.replay_endpoint, w, 1, fmt="vllm")
        # Conversations sharing system prompts, sent to random workers; small pools evict; some
        # evicted blocks go to the host tier.
        systems = [[rng.randrange(1000) for _ in range(8)] for _ in range(4)]
        prompts = [
            rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(4, 16))]
            for _ in range(60)
        ]
        for p in prompts:
            _, _, _, tee, cache, pool = rng.choice(workers)
            hashes = prompt_hashes(p, BS)
            hit = cache.match(hashes)
            pool.incref(hit)
            new = pool.allocate(len(hashes) - len(hit))
            blocks = hit + new
            for i in range(len(hit), len(hashes)):
                cache.insert(hashes[i], hashes[i - 1] if i else None, blocks[i], p[i * BS : (i + 1) * BS])
            if rng.random() < 0.3:
                tee.on_tier("stored", hashes[:2], "host")
            pool.free(blocks)
        states = {w: a.snapshot().blocks for w, a, *_ in workers}
        states = {w: {h: set(t) for h, t in s.items()} for w, s in states.items()}
        deadline = time.monotonic() + 30
        while not (_settled(own, states) and _settled(vllm, states)):
            assert time.monotonic() < deadline, "the indexes did not settle"
            # A feed learns of batches sent before its subscription from a later one: probes (the
            # removal of a block nobody holds) keep later ones coming.
            for _, a, b, *_ in workers:
                a.removed([bytes.fromhex(PROBE)], "device")
                b.removed([bytes.fromhex(PROBE)], "device")
            time.sleep(0.05)
        same = 0
        for p in prompts + [rng.choice(systems) + [1, 2, 3, 4] for _ in range(20)]:
            hashes = prompt_hashes(p, BS)
            with own.lock, vllm.lock:
                m_own, m_vllm = own.index.match(hashes), vllm.index.match(hashes)
            assert m_own == m_vllm
            best = lambda m: max(sorted(m), key=lambda w: m[w][0]) if m else None  # noqa: E731
            same += best(m_own) == best(m_vllm)
        assert same == 80
    finally:
        own.close()
        vllm.close()
        for _, a, b, *_ in workers:
            a.close()
            b.close()
