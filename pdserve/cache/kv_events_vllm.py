"""KV events in vLLM's wire format (cache.kv_events_format: vllm), both ways.

A worker publishing these is read by consumers written for vLLM (llm-d's KV cache indexer, Dynamo's
relay, vLLM's own decoder), and pdserve's router reads workers that publish them (vLLM's, or
pdserve's in this format) into the same global KV index as pdserve's own events.

The wire, as vLLM's `vllm.distributed.kv_events` defines it:

- PUB frames `[topic, seq, payload]`: seq an 8-byte big-endian count of batches from 0, one per
  batch; the topic `kv@<host>:<port>@<model>` (the worker's address and served model name).
- payload: msgpack of an event batch `[ts, events, data_parallel_rank]` (an array), each event a
  tagged struct: `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name), `BlockRemoved` (block_hashes, medium), `AllBlocksCleared`. vLLM releases
  differ in how an event is laid out: as a map with the tag under "type" (recent releases, the
  one pdserve's benchmarks install among them; `vllm`), or as an array with the tag first (earlier
  ones; `vllm-array`). Readers here take either, and a batch written as a map too.
- replay: a ROUTER socket; a request `[b"", start_seq]` (8 bytes, big-endian) is answered with
  `[b"", seq, payload]` for each buffered batch from start_seq on, then `[b"", -1, b""]` (recent vLLM
  releases answer `[b"", topic, seq, payload]`; the subscriber reads both).

pdserve's 16-byte block hashes travel as bytes (vLLM's hashes are bytes or ints). The medium names
the tier: GPU (device; on a CPU worker too: it is where the running requests' KV lives), CPU
(host RAM), STORAGE (disk), REMOTE (the shared remote tier). The first batch holds
AllBlocksCleared: a consumer drops what it credited this worker's earlier process with.

Unlike pdserve's format there is no snapshot: a subscriber that joins late or misses batches asks
the replay socket, which holds the last `buffer_steps` batches; a publisher whose own queue
overflowed (events lost before they had a seq) publishes AllBlocksCleared and then every block it
holds, so its consumers resynchronise. vLLM's consumers speak plain ZMQ, so these sockets have no
CurveZMQ: bind them where only your routers reach (a warning says so otherwise).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from pdserve.cache.kv_events import KVEventPublisher
from pdserve.cache.prefix_cache import block_hash
from pdserve.protocol import KVEvent, KVSnapshot

log = logging.getLogger(__name__)

FORMATS = ("pdserve", "vllm", "vllm-array")
MEDIUM = {"device": "GPU", "host": "CPU", "disk": "STORAGE", "remote": "REMOTE"}
# Mediums other engines may send; one this does not know counts as the slowest local tier.
TIER_OF_MEDIUM = {"GPU": "device", "CPU": "host", "STORAGE": "disk", "DISK": "disk", "REMOTE": "remote"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_REQUEST_MAX = 4096


def topic(host: str, model: str) -> str:
    return f"kv@{host}@{model}"


# ---------------------------------------------------------------------- the events and their codec


@dataclass
class BlockStored:
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes | int]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    pass


VLLMEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    ts: float
    events: list[VLLMEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


# Field order of each tagged struct, as vLLM declares them (an array layout depends on it).
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
# Fields an array layout carries (releases that wrote arrays had none after `medium`).
_ARRAY_FIELDS = {"BlockStored": _FIELDS["BlockStored"][:6], "BlockRemoved": ("block_hashes", "medium")}
_CLASSES: dict[str, type] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def encode_batch(batch: EventBatch, layout: str = "vllm") -> bytes:
    """msgpack of `batch` as vLLM's decoder of that layout reads it."""
    events: list[Any] = []
    for ev in batch.events:
        tag = type(ev).__name__
        if layout == "vllm-array":
            events.append([tag, *(getattr(ev, f) for f in _ARRAY_FIELDS.get(tag, ()))])
        else:
            events.append({"type": tag, **{f: getattr(ev, f) for f in _FIELDS[tag]}})
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def _hash_list(v: Any) -> list[bytes | int]:
    if not isinstance(v, list) or not all(isinstance(h, (bytes, int)) and not isinstance(h, bool) for h in v):
        raise ValueError("block_hashes must be a list of bytes or ints")
    return v


def _event(raw: Any) -> VLLMEvent:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        fields = dict(zip(_FIELDS.get(tag, ()), values))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, fields = raw["type"], {k: v for k, v in raw.items() if k in _FIELDS.get(raw["type"], ())}
    else:
        raise ValueError(f"not a tagged event: {type(raw).__name__}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        medium = fields.get("medium")
        return BlockRemoved(
            _hash_list(fields.get("block_hashes")), medium if isinstance(medium, str) else None
        )
    if tag != "BlockStored":
        raise ValueError(f"unknown event {tag!r}")
    parent = fields.get("parent_block_hash")
    tokens = fields.get("token_ids", [])
    size = fields.get("block_size", 0)
    if parent is not None and not isinstance(parent, (bytes, int)):
        raise ValueError("parent_block_hash must be bytes, an int or nil")
    if (
        not isinstance(tokens, list)
        or not all(isinstance(t, int) for t in tokens)
        or not isinstance(size, int)
    ):
        raise ValueError("token_ids must be a list of ints, block_size an int")
    lora_id, medium, lora_name = (fields.get(k) for k in ("lora_id", "medium", "lora_name"))
    return BlockStored(
        _hash_list(fields.get("block_hashes")),
        parent,
        tokens,
        size,
        lora_id if isinstance(lora_id, int) else None,
        medium if isinstance(medium, str) else None,
        lora_name if isinstance(lora_name, str) else None,
    )


def decode_batch(payload: bytes) -> EventBatch:
    """An event batch in any of vLLM's layouts. Raises ValueError for anything else."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack's errors share no base class worth naming
        raise ValueError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("not an event batch")
    ts, rank = raw[0], raw[2] if len(raw) > 2 else None
    if not isinstance(ts, (int, float)) or (rank is not None and not isinstance(rank, int)):
        raise ValueError("bad batch timestamp or data-parallel rank")
    return EventBatch(float(ts), [_event(e) for e in raw[1]], rank)


def hash_key(h: bytes | int) -> str:
    """A block hash as the KV index names it: pdserve's are hex of the bytes; an int hash (vLLM's
    older builtin hashing) is hex of its 64 bits."""
    return h.hex() if isinstance(h, bytes) else format(h & 0xFFFF_FFFF_FFFF_FFFF, "016x")


# ---------------------------------------------------------------------- the publisher (a worker)


class VLLMEventPublisher(KVEventPublisher):
    """pdserve's publisher (the same producer calls, queue and socket thread) writing vLLM's wire.
    The second socket, a ROUTER at `replay_endpoint`, answers replay requests."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        replay_endpoint: str | None,
        *,
        topic: str,
        block_size: int,
        layout: str = "vllm",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        advertise_host: str | None = None,
        context: zmq.Context | None = None,
        max_pending: int = 100_000,
        max_batch: int = 1000,
        sndhwm: int = 10_000,
    ) -> None:
        if layout not in ("vllm", "vllm-array"):
            raise ValueError(f"unknown vLLM event layout {layout!r}")
        # Set before the base starts the socket thread, which reads them.
        self.topic = topic.encode()
        self.block_size = block_size
        self.layout = layout
        self.data_parallel_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._meta: dict[str, tuple[str | None, tuple[int, ...]]] = {}  # hash -> (parent, its tokens)
        self._resync = False
        self.replays_served = 0
        super().__init__(
            endpoint,
            worker_id,
            replay_endpoint,
            max_pending=max_pending,
            max_batch=max_batch,
            sndhwm=sndhwm,
            context=context,
            advertise_host=advertise_host,
        )
        self.replay_endpoint, self.snapshot_endpoint = self.snapshot_endpoint, None
        if self._snap is not None:
            self._snap.setsockopt(zmq.MAXMSGSIZE, _REPLAY_REQUEST_MAX)
        with self._lock:
            self._queue_event("cleared", [], None, "device")

    def on_tier(self, kind: str, hashes: list[bytes], tier: str) -> None:
        """A lower tier's blocks are not a chain: each is stored under its own parent (known from when
        the device held it), so that a consumer chaining hashes from token ids gets them right."""
        if kind != "stored":
            return super().on_tier(kind, hashes, tier)
        for h in hashes:
            meta = self._meta.get(h.hex() if isinstance(h, bytes) else h)
            self.stored([h], meta[0] if meta is not None else None, tier)

    # ------------------------------------------------------------------ hooks of the base (under its lock)

    def _block_tokens(self, hexes: list[str], parent: str | None, token_ids: Sequence[int] | None):
        bs = self.block_size
        if token_ids is not None and len(token_ids) == bs * len(hexes):
            for i, h in enumerate(hexes):
                self._meta[h] = (parent if i == 0 else hexes[i - 1], tuple(token_ids[i * bs : (i + 1) * bs]))
            return list(token_ids)
        # A lower tier's copy of a block the device held: its tokens are known from then.
        known = [self._meta.get(h) for h in hexes]
        if all(m is not None for m in known):
            return [t for m in known if m is not None for t in m[1]]
        return None

    def _forget(self, h: str) -> None:
        self._meta.pop(h, None)

    def _on_drop(self) -> None:
        self._resync = True

    def _drain(self) -> list[dict[str, Any]]:
        if not self._resync:
            return super()._drain()
        # Events were lost before they had a seq, so no replay can bring them back: start over from the
        # state (which the producers kept up to date), as a restarted worker would.
        self._resync = False
        self._queue.clear()
        events: list[dict[str, Any]] = [
            {"type": "cleared", "block_hashes": [], "parent_hash": None, "tier": "device"}
        ]
        for h, tiers in self._blocks.items():
            parent, tokens = self._meta.get(h, (None, None))
            for tier in tiers:
                ev = {"type": "stored", "block_hashes": [h], "parent_hash": parent, "tier": tier}
                if tokens is not None:
                    ev["token_ids"] = list(tokens)
                events.append(ev)
        log.warning(
            "KV events: the queue overflowed; republishing all %d blocks after AllBlocksCleared",
            len(self._blocks),
        )
        return events

    def snapshot(self) -> KVSnapshot:
        raise NotImplementedError("vLLM-format KV events have no snapshots; subscribers replay")

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(super().stats())
        s.pop("kv_snapshots_served_total", None)
        with self._lock:
            s["kv_event_replays_served_total"] = float(self.replays_served)
        s["kv_events_format"] = self.layout
        s["kv_events_replay_endpoint"] = self.replay_endpoint
        s["kv_events_topic"] = self.topic.decode()
        return s

    # ------------------------------------------------------------------ the socket thread

    def _vllm_event(self, ev: dict[str, Any]) -> VLLMEvent:
        medium = MEDIUM[ev["tier"]]
        hashes: list[bytes | int] = [bytes.fromhex(h) for h in ev["block_hashes"]]
        if ev["type"] == "cleared":
            return AllBlocksCleared()
        if ev["type"] == "removed":
            return BlockRemoved(hashes, medium)
        parent = bytes.fromhex(ev["parent_hash"]) if ev["parent_hash"] is not None else None
        return BlockStored(hashes, parent, ev.get("token_ids", []), self.block_size, None, medium, None)

    def _publish(self, chunk: list[dict[str, Any]]) -> bool:
        batch = EventBatch(time.time(), [self._vllm_event(ev) for ev in chunk], self.data_parallel_rank)
        payload = encode_batch(batch, self.layout)
        seq = self._next_seq
        self._next_seq += 1
        # Kept for replay even when the send fails: the subscriber sees the gap and asks for it.
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _serve_snapshots(self) -> None:
        """The ROUTER socket answers replay requests here."""
        sock = self._snap
        assert sock is not None
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: ignoring a malformed replay request")
                continue
            peer, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        sock.send_multipart([peer, b"", seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
                sock.send_multipart([peer, b"", END_SEQ, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # a peer that stopped reading loses its replay, not the publisher
                log.warning("KV events: replay to a subscriber failed: %s", e)
            with self._lock:
                self.replays_served += 1


# ---------------------------------------------------------------------- the subscriber (a router)


class VLLMEventSubscriber:
    """A router's view of one worker publishing vLLM's format: SUB to its events, and its replay
    socket for what it missed. `poll` gives what to apply to the index: a KVSnapshot (empty: the
    worker's blocks are cleared; the first thing given) or KVEvents in order, numbered here (the
    index wants consecutive numbers per worker)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        worker_id: str,
        *,
        context: zmq.Context | None = None,
        replay_timeout: float = 2.0,
        rcvhwm: int = 100_000,
        rehash: bool = False,
    ) -> None:
        """`rehash`: name blocks by the router's own chain hash of their token ids (prefix_cache.
        block_hash over the parent's), not the worker's hashes, whose function the router need not know
        (vLLM's): a prompt's block hashes (prompt_hashes at the worker's block size) then match them."""
        self._ctx = context or zmq.Context.instance()
        self.replay_endpoint = replay_endpoint
        self.snapshot_endpoint = None  # the feed's snapshot logic does not apply
        self.worker_id = worker_id
        self.replay_timeout = replay_timeout
        self.last_seq: int | None = None  # the publisher's batch seq last applied
        self.gaps = 0  # batches neither received nor replayed
        self.replays = 0
        self.malformed = 0
        self._n = 0  # KVEvents given so far
        self.rehash = rehash
        self.block_size: int | None = None  # the worker's, from its BlockStored events (rehash)
        self.unchained = 0  # stored blocks left out: their parent was never seen, or their tokens do not fit
        # rehash: the worker's hash key -> (the router's chain hash, the mediums holding the block)
        self._ours: dict[str, tuple[bytes, set[str]]] = {}
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)

    def poll(self, timeout: float = 0.0) -> list[KVEvent | KVSnapshot]:
        out: list[KVEvent | KVSnapshot] = []
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if self.last_seq is not None and seq <= self.last_seq:
                continue  # replayed already
            expected = 0 if self.last_seq is None else self.last_seq + 1
            if seq > expected:
                self._catch_up(expected, seq, out)
            self._apply(seq, frames[2], out)
        return out

    def _catch_up(self, start: int, upto: int, out: list) -> None:
        """Batches start..upto-1 from the replay socket (those it no longer holds count as gaps)."""
        if self.replay_endpoint is None:
            return
        try:
            got = self.replay(start)
        except TimeoutError as e:
            log.warning("KV events: %s", e)
            return
        self.replays += 1
        for seq, payload in sorted(got, key=lambda x: x[0]):
            if seq >= upto:
                break
            if self.last_seq is None or seq > self.last_seq:
                self._apply(seq, payload, out)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The publisher's buffered batches from `start` on. Raises TimeoutError past the deadline."""
        sock = self._ctx.socket(zmq.DEALER)  # one per call: a late answer must not meet the next request
        sock.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + self.replay_timeout
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    raise TimeoutError(
                        f"replay from {self.replay_endpoint} unfinished within {self.replay_timeout}s"
                    )
                frames = sock.recv_multipart()
                if len(frames) == 4:  # recent vLLM releases put the topic before the seq
                    frames = [frames[0], *frames[2:]]
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    return got
                got.append((seq, frames[2]))
        finally:
            sock.close()

    def _start(self, out: list) -> None:
        self._ours.clear()
        out.append(KVSnapshot(worker_id=self.worker_id, seq=self._n, blocks={}))

    def _rehashed(self, ev: BlockStored | BlockRemoved) -> tuple[list[str], str | None]:
        """The event's blocks and parent as the router names them (rehash); ([], None) to skip it."""
        medium = ev.medium or "GPU"
        if isinstance(ev, BlockRemoved):
            names = []
            for h in ev.block_hashes:
                entry = self._ours.get(hash_key(h))
                if entry is None:
                    continue
                names.append(entry[0].hex())
                entry[1].discard(medium)
                if not entry[1]:
                    del self._ours[hash_key(h)]
            return names, None
        bs, n = ev.block_size, len(ev.block_hashes)
        parent: bytes | None = None
        if ev.parent_block_hash is not None:
            known = self._ours.get(hash_key(ev.parent_block_hash))
            parent = known[0] if known is not None else None
        if bs <= 0 or len(ev.token_ids) != bs * n or (ev.parent_block_hash is not None and parent is None):
            self.unchained += n  # a gap before the subscription or a lost batch: the chain cannot be rebuilt
            return [], None
        self.block_size = bs
        first_parent = parent.hex() if parent is not None else None
        names = []
        for i, h in enumerate(ev.block_hashes):
            parent = block_hash(parent, ev.token_ids[i * bs : (i + 1) * bs])
            entry = self._ours.setdefault(hash_key(h), (parent, set()))
            entry[1].add(medium)
            names.append(parent.hex())
        return names, first_parent

    def _apply(self, seq: int, payload: bytes, out: list) -> None:
        expected = 0 if self.last_seq is None else self.last_seq + 1
        self.gaps += max(0, seq - expected)
        if self.last_seq is None:
            self._start(out)  # a subscriber that joined late credits the worker with nothing before
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except ValueError as e:  # garbage must not stop the router
            self.malformed += 1
            log.warning("KV events: dropping a malformed vLLM batch: %s", e)
            return
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self._start(out)
                continue
            tier = TIER_OF_MEDIUM.get(ev.medium or "GPU", "disk")
            if self.rehash:
                names, parent_name = self._rehashed(ev)
                if not names:
                    continue
            else:
                parent = ev.parent_block_hash if isinstance(ev, BlockStored) else None
                names = [hash_key(h) for h in ev.block_hashes]
                parent_name = hash_key(parent) if parent is not None else None
            self._n += 1
            out.append(
                KVEvent(
                    type="stored" if isinstance(ev, BlockStored) else "removed",
                    block_hashes=names,
                    parent_hash=parent_name,
                    tier=tier,  # type: ignore[arg-type]
                    worker_id=self.worker_id,
                    seq=self._n,
                    ts=batch.ts,
                )
            )

    def close(self) -> None:
        self._sub.close()
