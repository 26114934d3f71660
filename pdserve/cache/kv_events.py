"""KV events: workers tell routers which blocks they hold in which tier.

A worker's KVEventPublisher sends batches of events on a ZMQ PUB socket and answers snapshot
requests (its whole block -> tiers state and the last seq) on a ROUTER socket. A router keeps a
KVIndex per deployment, fed by one KVEventSubscriber per worker: snapshot once, then events; an
event with seq <= the snapshot's is already in it, and a gap in seq (PUB drops on overflow, a
worker restart) marks the worker for a fresh snapshot. Publishing never blocks the engine: events
go to an in-memory queue that a thread owning the sockets drains; past its bound they are dropped
(counted, and the gap shows up at the routers).

Block hashes are a cache-probing oracle (hash a guessed prompt, watch for it), so both sockets are
for the router only: a one-machine deployment binds them on loopback (worker_process.py), and with
an internal token they are CurveZMQ servers whose keys derive from the token, accepting only
clients that hold it: events and snapshots are encrypted, and nobody else can subscribe or ask.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
from zmq.utils import z85

from pdserve.cache.kv_index import TIER_RANK, KVIndex, hash_hex
from pdserve.protocol import KV_TIERS, KVEvent, KVEventBatch, KVSnapshot
from pdserve.utils.net import with_host

log = logging.getLogger(__name__)

__all__ = ["KVEventPublisher", "KVEventSubscriber", "KVIndex"]

TOPIC = b"kv"
_SNAPSHOT_REQUEST = b"snapshot"
_SNAPSHOT_REQUEST_MAX = 4096  # the request, or a CurveZMQ handshake command (a few hundred bytes)


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


_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (one per context)


def curve_keys(token: str, side: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CurveZMQ keys of `side` (b"server" or b"client"), derived from the token."""
    secret = z85.encode(hmac.new(token.encode(), b"pdserve kv-events " + side, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def _curve_client(sock: zmq.Socket, token: str) -> None:
    sock.curve_serverkey = curve_keys(token, b"server")[0]
    sock.curve_publickey, sock.curve_secretkey = curve_keys(token, b"client")


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        snapshot_endpoint: str | None = None,
        *,
        max_pending: int = 100_000,
        sndhwm: int = 10_000,
        max_batch: int = 1000,
        context: zmq.Context | None = None,
        advertise_host: str | None = None,
        token: str | None = None,
    ) -> None:
        """Binds both sockets now (errors surface here); tcp://host:* picks a free port, see .endpoint
        (named with `advertise_host` when given: what subscribers on other machines connect to).
        With `token` (the internal token) only subscribers holding it connect; the publisher then
        has a context of its own, whose ZAP handler (one per context) it is."""
        self.worker_id = worker_id
        self.max_pending = max_pending
        self.max_batch = max_batch
        self._own_ctx = zmq.Context() if token else None
        ctx = self._own_ctx or context or zmq.Context.instance()
        self._zap = None
        if token:
            self._zap = ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(_ZAP_ENDPOINT)
            self._client_key = z85.decode(curve_keys(token, b"client")[0])
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, sndhwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._snap = ctx.socket(zmq.ROUTER) if snapshot_endpoint is not None else None
        for sock in (self._pub, self._snap):
            if token and sock is not None:
                sock.curve_server = True
                sock.curve_secretkey = curve_keys(token, b"server")[1]
                sock.zap_domain = b"pdserve-kv-events"
        try:
            _bind(self._pub, endpoint)
            self.endpoint = with_host(self._pub.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
            self.snapshot_endpoint = None
            if self._snap is not None:
                self._snap.setsockopt(zmq.LINGER, 0)
                # It takes one short request: a peer streaming more is cut off before it is buffered.
                self._snap.setsockopt(zmq.MAXMSGSIZE, _SNAPSHOT_REQUEST_MAX)
                _bind(self._snap, snapshot_endpoint)
                self.snapshot_endpoint = with_host(
                    self._snap.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host
                )
        except zmq.ZMQError:
            for sock in (self._pub, self._snap, self._zap):
                if sock is not None:
                    sock.close()
            if self._own_ctx is not None:
                self._own_ctx.term()
            raise
        # A pipe wakes the socket thread: zmq polls raw fds, and pipe writes are thread-safe.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._queue: deque[dict[str, Any]] = deque()
        self._open: dict[str, Any] | None = None  # last queued event, still extendable
        self._blocks: dict[str, set[str]] = {}  # this worker's state, for snapshots
        self._seq = time.time_ns() // 1000  # grows across restarts too
        self._signaled = False
        self._closing = False
        self.published = 0
        self.dropped = 0
        self.snapshots_served = 0
        self.refused = 0  # peers without the token's key
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producers (any thread)

    def stored(
        self,
        hashes: list[bytes] | list[str],
        parent: bytes | str | None = None,
        tier: str = "device",
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """`token_ids`: the blocks' tokens when known (pdserve's own format leaves them out)."""
        hexes = [hash_hex(h) for h in hashes]
        if not hexes:
            return
        _check_tier(tier)
        parent_hex = hash_hex(parent) if parent is not None else None
        with self._lock:
            for h in hexes:
                self._blocks.setdefault(h, set()).add(tier)
            tokens = self._block_tokens(hexes, parent_hex, token_ids)
            ev = self._open
            if (
                ev is not None
                and ev["type"] == "stored"
                and ev["tier"] == tier
                and parent_hex is not None
                and ev["block_hashes"][-1] == parent_hex
                and (tokens is None) == ("token_ids" not in ev)
            ):
                ev["block_hashes"].extend(hexes)  # the chain goes on: one event, not one per block
                if tokens is not None:
                    ev["token_ids"].extend(tokens)
                return
            self._queue_event("stored", hexes, parent_hex, tier)
            if tokens is not None and self._open is not None:
                self._open["token_ids"] = tokens

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
                        self._forget(h)
            ev = self._open
            if ev is not None and ev["type"] == "removed" and ev["tier"] == tier:
                ev["block_hashes"].extend(hexes)
                return
            self._queue_event("removed", hexes, None, tier)

    def on_prefix_cache(
        self,
        kind: str,
        block_hash: bytes,
        parent: bytes | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """A PrefixCache listener: the device tier."""
        if kind == "stored":
            self.stored([block_hash], parent, "device", token_ids)
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
            self._on_drop()
        else:
            ev = {
                "type": kind,
                "block_hashes": hexes,
                "parent_hash": parent,
                "tier": tier,
                "worker_id": self.worker_id,
                "seq": self._seq,
                "ts": time.time(),
            }
            self._queue.append(ev)
            self._open = ev
        if not self._signaled:  # a dropped event wakes it too: a full queue must drain
            self._signaled = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass

    # Hooks of a publisher in another wire format (cache/kv_events_vllm.py); called under self._lock.

    def _block_tokens(self, hexes: list[str], parent: str | None, token_ids: Sequence[int] | None):
        """The stored blocks' token ids to put in the event, or None: pdserve's format has none."""
        return None

    def _forget(self, h: str) -> None:
        """Block `h` left every tier."""

    def _on_drop(self) -> None:
        """An event was dropped (the queue was full); the gap in seq tells pdserve's subscribers."""

    def _drain(self) -> list[dict[str, Any]]:
        events = list(self._queue)
        self._queue.clear()
        return events

    @property
    def seq(self) -> int:
        return self._seq

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            self._open = None  # events up to seq are final: the snapshot includes them
            blocks = {h: sorted(t, key=TIER_RANK.__getitem__) for h, t in self._blocks.items()}
            seq = self._seq
        return KVSnapshot(worker_id=self.worker_id, seq=seq, blocks=blocks)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "kv_events_published_total": float(self.published),
                "kv_events_dropped_total": float(self.dropped),
                "kv_events_pending": float(len(self._queue)),
                "kv_snapshots_served_total": float(self.snapshots_served),
            }

    # ------------------------------------------------------------------ the socket thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for sock in (self._snap, self._zap):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while not self._closing:
                ready = dict(poller.poll())
                if self._zap is not None and self._zap in ready:
                    self._authenticate()
                if self._wake_r in ready:
                    self._send_pending()
                if self._snap is not None and self._snap in ready:
                    self._serve_snapshots()
            self._send_pending()
        except Exception:
            log.exception("KV event publisher stopped")
        finally:
            for sock in (self._pub, self._snap, self._zap):
                if sock is not None:
                    sock.close()

    def _authenticate(self) -> None:
        """Answers libzmq's ZAP request for a connecting peer: only the token's client key gets in."""
        zap = self._zap
        assert zap is not None
        frames = zap.recv_multipart()
        request_id = frames[1] if len(frames) > 1 else b""
        key = frames[6] if len(frames) > 6 and frames[5] == b"CURVE" else b""
        ok = hmac.compare_digest(key, self._client_key)
        if not ok:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, ...: a retrying peer cannot flood the log
                log.warning(
                    "KV events: refused a subscriber without the internal token (%d so far)", self.refused
                )
        zap.send_multipart(
            [
                b"1.0",
                request_id,
                b"200" if ok else b"400",
                b"OK" if ok else b"not the internal token's key",
                b"",
                b"",
            ]
        )

    def _send_pending(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            self._signaled = False
            self._open = None
            events = self._drain()
        for i in range(0, len(events), self.max_batch):
            chunk = events[i : i + self.max_batch]
            sent = self._publish(chunk)
            with self._lock:
                self.published += len(chunk) if sent else 0
                self.dropped += 0 if sent else len(chunk)

    def _publish(self, chunk: list[dict[str, Any]]) -> bool:
        """Send one batch (socket thread); False when the PUB socket's queue is full."""
        payload = msgpack.packb({"worker_id": self.worker_id, "events": chunk})
        try:
            self._pub.send_multipart([TOPIC, payload], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

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
        if self._own_ctx is not None and not self._thread.is_alive():
            self._own_ctx.term()


class KVEventSubscriber:
    """A router's view of one worker: SUB to its events, REQ for its snapshot."""

    def __init__(
        self,
        endpoint: str,
        snapshot_endpoint: str | None = None,
        *,
        context: zmq.Context | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: the internal token, when the workers have one (their sockets then take only its key)."""
        self._ctx = context or zmq.Context.instance()
        self._token = token
        self.snapshot_endpoint = snapshot_endpoint
        self.worker_id: str | None = None  # known after the first snapshot
        self.malformed = 0
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        if token:
            _curve_client(self._sub, token)
        self._sub.connect(endpoint)

    def snapshot(self, timeout: float = 5.0) -> KVSnapshot:
        """The worker's full state. Raises TimeoutError when it does not answer in time."""
        if self.snapshot_endpoint is None:
            raise ValueError("no snapshot endpoint")
        req = self._ctx.socket(zmq.REQ)  # one per call: a REQ that timed out cannot send again
        req.setsockopt(zmq.LINGER, 0)
        if self._token:
            _curve_client(req, self._token)
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
            except (ValueError, TypeError, IndexError) as e:  # garbage must not stop the router
                self.malformed += 1
                log.warning("KV events: dropping a malformed batch: %s", e)
                continue
            events.extend(batch.events)
        return events

    def update(self, index: KVIndex, timeout: float = 0.0) -> int:
        """Apply new events to `index`, taking a snapshot first when the index lacks or lost this
        worker's state. Returns how many events were applied."""
        applied = sum(index.apply(ev) for ev in self.poll(timeout))
        if self.snapshot_endpoint is not None and (
            self.worker_id is None or self.worker_id in index.needs_snapshot
        ):
            index.apply_snapshot(self.snapshot())
        return applied

    def close(self) -> None:
        self._sub.close()
