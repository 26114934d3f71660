"""KV events: workers tell routers which blocks they hold in which tier.

A worker's KVEventPublisher sends batches of events on a ZMQ PUB socket and answers snapshot
requests (its whole block -> tiers state and the last seq) on a ROUTER socket. A router keeps a
KVIndex per deployment, fed by one KVEventSubscriber per worker: snapshot once, then events; an
event with seq <= the snapshot's is already in it, and a gap in seq (PUB drops on overflow, a
worker restart) marks the worker for a fresh snapshot. Publishing never blocks the engine: events
go to an in-memory queue that a thread owning the sockets drains; past its bound they are dropped
(counted, and the gap shows up at the routers).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from pdserve.cache.kv_index import TIER_RANK, KVIndex, hash_hex
from pdserve.protocol import KV_TIERS, KVEvent, KVEventBatch, KVSnapshot
from pdserve.utils.net import with_host

log = logging.getLogger(__name__)

__all__ = ["KVEventPublisher", "KVEventSubscriber", "KVIndex"]

TOPIC = b"kv"
_SNAPSHOT_REQUEST = b"snapshot"


def _check_tier(tier: str) -> None:
    # An unknown tier would fail validation at every router and cost them the whole batch.
    if tier not in TIER_RANK:
        raise ValueError(f"unknown KV tier {tier!r}; known: {KV_TIERS}")


def _bind(sock: zmq.Socket, endpoint: str, wait_s: float = 3.0) -> None:
    """Binds, retrying a fixed port that is still in use for up to wait_s: zmq releases a closed
    socket's port on its I/O thread, after close() returns, so a publisher recreated in the same
    process on the same endpoint (a restart under the same name) could find it taken a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or endpoint.endswith(":*") or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class KVEventPublisher:
    def __init__(self, endpoint: str, worker_id: str, snapshot_endpoint: str | None = None, *,
                 max_pending: int = 100_000, sndhwm: int = 10_000, max_batch: int = 1000,
                 context: zmq.Context | None = None, advertise_host: str | None = None) -> None:
        """Binds both sockets now (errors surface here); tcp://host:* picks a free port, see .endpoint
        (named with `advertise_host` when given: what subscribers on other machines connect to)."""
        self.worker_id = worker_id
        self.max_pending = max_pending
        self.max_batch = max_batch
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, sndhwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._snap = ctx.socket(zmq.ROUTER) if snapshot_endpoint is not None else None
        try:
            _bind(self._pub, endpoint)
            self.endpoint = with_host(self._pub.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
            self.snapshot_endpoint = None
            if self._snap is not None:
                self._snap.setsockopt(zmq.LINGER, 0)
                _bind(self._snap, snapshot_endpoint)
                self.snapshot_endpoint = with_host(self._snap.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        except zmq.ZMQError:
            self._pub.close()
            if self._snap is not None:
                self._snap.close()
            raise
        # A pipe wakes the socket thread: zmq polls raw fds, and pipe writes are thread-safe.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._queue: deque[dict[str, Any]] = deque()
        self._open: dict[str, Any] | None = None     # last queued event, still extendable
        self._blocks: dict[str, set[str]] = {}       # this worker's state, for snapshots
        self._seq = time.time_ns() // 1000           # grows across restarts too
        self._signaled = False
        self._closing = False
        self.published = 0
        self.dropped = 0
        self.snapshots_served = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producers (any thread)

    def stored(self, hashes: list[bytes] | list[str], parent: bytes | str | None = None,
               tier: str = "device") -> None:
        hexes = [hash_hex(h) for h in hashes]
        if not hexes:
            return
        _check_tier(tier)
        parent_hex = hash_hex(parent) if parent is not None else None
        with self._lock:
            for h in hexes:
                self._blocks.setdefault(h, set()).add(tier)
            ev = self._open
            if (ev is not None and ev["type"] == "stored" and ev["tier"] == tier
                    and parent_hex is not None and ev["block_hashes"][-1] == parent_hex):
                ev["block_hashes"].extend(hexes)      # the chain goes on: one event, not one per block
                return
            self._queue_event("stored", hexes, parent_hex, tier)

    def removed(self, hashes: list[bytes] | list[str], tier: str = "device") -> None:
        hexes = [hash_hex(h) for h in hashes]
        if not hexes:
            return
        _check_tier(tier)
        with self._lock:
            for h in hexes:
                tiers = self._blocks.get(h)
                if tiers is not None:
                    tiers.discard(tier)
                    if not tiers:
                        del self._blocks[h]
            ev = self._open
            if ev is not None and ev["type"] == "removed" and ev["tier"] == tier:
                ev["block_hashes"].extend(hexes)
                return
            self._queue_event("removed", hexes, None, tier)

    def on_prefix_cache(self, kind: str, block_hash: bytes, parent: bytes | None = None) -> None:
        """A PrefixCache listener: the device tier."""
        if kind == "stored":
            self.stored([block_hash], parent, "device")
        else:
            self.removed([block_hash], "device")

    def on_tier(self, kind: str, hashes: list[bytes], tier: str) -> None:
        """A TieredKVStore listener: the host, disk and remote tiers."""
        if kind == "stored":
            self.stored(hashes, None, tier)
        else:
            self.removed(hashes, tier)

    def _queue_event(self, kind: str, hexes: list[str], parent: str | None, tier: str) -> None:
        # Under self._lock. The seq is taken even when the event is dropped, so routers see the gap.
        self._seq += 1
        if len(self._queue) >= self.max_pending:
            self.dropped += 1
            self._open = None
            return
        ev = {"type": kind, "block_hashes": hexes, "parent_hash": parent, "tier": tier,
              "worker_id": self.worker_id, "seq": self._seq, "ts": time.time()}
        self._queue.append(ev)
        self._open = ev
        if not self._signaled:
            self._signaled = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass

    @property
    def seq(self) -> int:
        return self._seq

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            self._open = None         # events up to seq are final: the snapshot includes them
            blocks = {h: sorted(t, key=TIER_RANK.__getitem__) for h, t in self._blocks.items()}
            seq = self._seq
        return KVSnapshot(worker_id=self.worker_id, seq=seq, blocks=blocks)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"kv_events_published_total": float(self.published), "kv_events_dropped_total": float(self.dropped),
                    "kv_events_pending": float(len(self._queue)),
                    "kv_snapshots_served_total": float(self.snapshots_served)}

    # ------------------------------------------------------------------ the socket thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._snap is not None:
            poller.register(self._snap, zmq.POLLIN)
        try:
            while not self._closing:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    self._send_pending()
                if self._snap is not None and self._snap in ready:
                    self._serve_snapshots()
            self._send_pending()
        except Exception:
            log.exception("KV event publisher stopped")
        finally:
            self._pub.close()
            if self._snap is not None:
                self._snap.close()

    def _send_pending(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            self._signaled = False
            self._open = None
            events = list(self._queue)
            self._queue.clear()
        for i in range(0, len(events), self.max_batch):
            chunk = events[i:i + self.max_batch]
            payload = msgpack.packb({"worker_id": self.worker_id, "events": chunk})
            try:
                self._pub.send_multipart([TOPIC, payload], flags=zmq.NOBLOCK)
                sent, lost = len(chunk), 0
            except zmq.Again:
                sent, lost = 0, len(chunk)
            with self._lock:
                self.published += sent
                self.dropped += lost

    def _serve_snapshots(self) -> None:
        while True:
            try:
                frames = self._snap.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[2] != _SNAPSHOT_REQUEST:
                log.warning("KV events: ignoring a malformed snapshot request")
                continue
            body = msgpack.packb(self.snapshot().model_dump())
            with self._lock:
                self.snapshots_served += 1
            try:
                self._snap.send_multipart([frames[0], b"", body], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("KV events: snapshot reply failed: %s", e)

    def close(self, timeout: float = 5.0) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        self._thread.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)


class KVEventSubscriber:
    """A router's view of one worker: SUB to its events, REQ for its snapshot."""

    def __init__(self, endpoint: str, snapshot_endpoint: str | None = None, *,
                 context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self.snapshot_endpoint = snapshot_endpoint
        self.worker_id: str | None = None       # known after the first snapshot
        self.malformed = 0
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.connect(endpoint)

    def snapshot(self, timeout: float = 5.0) -> KVSnapshot:
        """The worker's full state. Raises TimeoutError when it does not answer in time."""
        if self.snapshot_endpoint is None:
            raise ValueError("no snapshot endpoint")
        req = self._ctx.socket(zmq.REQ)     # one per call: a REQ that timed out cannot send again
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self.snapshot_endpoint)
            req.send(_SNAPSHOT_REQUEST)
            if not req.poll(int(timeout * 1000)):
                raise TimeoutError(f"no KV snapshot from {self.snapshot_endpoint} within {timeout}s")
            snap = KVSnapshot.model_validate(msgpack.unpackb(req.recv()))
        finally:
            req.close()
        self.worker_id = snap.worker_id
        return snap

    def poll(self, timeout: float = 0.0) -> list[KVEvent]:
        """Events received so far, waiting up to `timeout` seconds for the first one."""
        events: list[KVEvent] = []
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            try:
                batch = KVEventBatch.model_validate(msgpack.unpackb(frames[1]))
            except (ValueError, TypeError, IndexError) as e:    # garbage must not stop the router
                self.malformed += 1
                log.warning("KV events: dropping a malformed batch: %s", e)
                continue
            events.extend(batch.events)
        return events

    def update(self, index: KVIndex, timeout: float = 0.0) -> int:
        """Apply new events to `index`, taking a snapshot first when the index lacks or lost this
        worker's state. Returns how many events were applied."""
        applied = sum(index.apply(ev) for ev in self.poll(timeout))
        if self.snapshot_endpoint is not None and (self.worker_id is None or self.worker_id in index.needs_snapshot):
            index.apply_snapshot(self.snapshot())
        return applied

    def close(self) -> None:
        self._sub.close()
