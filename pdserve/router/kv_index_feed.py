"""Feeds the router's global KV index from the workers' KV events (a thread owning the ZMQ sockets).

Workers report their event endpoints in /health; the feed subscribes to each one it sees, takes a
snapshot first (so a restarted router rebuilds the index), then applies events. A worker that leaves
the registry (retired, removed) is no longer followed: its subscriber is closed, its blocks dropped.

A worker that restarts comes back with none of its blocks, often under the same name and event
endpoint, and before it publishes anything the index would go on crediting it with the old
process's blocks. The router tells the feed each worker's instance (its pid and snapshot endpoint,
a free port per start): a new instance drops the worker's entries at once and resubscribes, the
new subscriber starting from a snapshot. A seq gap in the events (a restart the router did not see,
or PUB drops) also asks for a snapshot (cache/kv_index.py). Snapshots are fetched outside the
index lock (routing reads the index on the event loop), and one that times out (a worker gone
silent) is retried after a pause instead of stalling the other workers' events each round.

A worker may publish vLLM's format instead (its /health says kv_events_format: vllm): its events
feed the same index, through cache/kv_events_vllm.py's subscriber, which replays what it missed
(there are no snapshots in that format) and names the worker as the router does.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from pdserve.cache.kv_events import KVEventSubscriber
from pdserve.cache.kv_events_vllm import VLLMEventSubscriber
from pdserve.cache.kv_index import KVIndex
from pdserve.protocol import KVSnapshot

log = logging.getLogger(__name__)
SNAPSHOT_TIMEOUT_S = 2.0
SNAPSHOT_RETRY_S = 5.0


class IndexFeed:
    def __init__(self, token: str | None = None, rehash: bool = False) -> None:
        """`token`: the internal token, which the workers' event sockets take (cache/kv_events.py).
        `rehash`: vLLM-format blocks are named by the router's hash of their token ids (workers of other
        engines, whose hash function the router does not share; router/front.py)."""
        self.token = token
        self.rehash = rehash
        self.index = KVIndex()
        self.lock = threading.Lock()
        # event endpoint -> subscriber (kv-index thread)
        self._subs: dict[str, KVEventSubscriber | VLLMEventSubscriber] = {}
        self._retry_at: dict[str, float] = {}  # event endpoint -> next snapshot try (kv-index thread)
        # Written by the event loop, read by the kv-index thread (single dict operations).
        self._wanted: dict[str, str | None] = {}  # event endpoint -> snapshot (vLLM format: replay) endpoint
        self._vllm: dict[str, str] = {}  # event endpoint -> worker name, for workers publishing vLLM's format
        self._instances: dict[str, object] = {}  # event endpoint -> the worker's instance
        self._renewed: set[str] = set()  # endpoints whose subscriber must be remade
        self._names: dict[str, str] = {}  # event endpoint -> the worker's own name
        self._dropped: dict[str, str | None] = {}  # endpoints no longer followed -> worker name
        self.restarts_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)
        self._thread.start()

    def watch(
        self,
        endpoint: str | None,
        snapshot_endpoint: str | None,
        name: str | None = None,
        instance: object = None,
        fmt: str = "pdserve",
    ) -> None:
        """Follow a worker's events. `instance`: what identifies its process (a restart changes it);
        a different one than last time drops `name`'s entries and resubscribes from a snapshot.
        `fmt`: the worker's kv_events_format; with vLLM's, `snapshot_endpoint` is its replay socket
        and `name` is required (the events do not name their worker)."""
        if not endpoint:
            return
        if fmt != "pdserve":
            if not name:
                return
            self._vllm[endpoint] = name
        if name:
            self._names[endpoint] = name
        self._dropped.pop(endpoint, None)  # a worker back before its subscriber was closed
        known = self._instances.get(endpoint)
        self._instances[endpoint] = instance
        if endpoint not in self._wanted:
            self._wanted[endpoint] = snapshot_endpoint
        elif instance is not None and known is not None and known != instance:
            log.info(
                "worker %s restarted (%s -> %s): dropping its %d indexed blocks until its snapshot",
                name or endpoint,
                known,
                instance,
                self.blocks_of(name),
            )
            self.restarts_seen += 1
            self._wanted[endpoint] = snapshot_endpoint
            self._renewed.add(endpoint)
            if name:
                with self.lock:
                    self.index.remove_worker(name)

    def retain(self, endpoints: set[str]) -> None:
        """Stop following every worker whose endpoint is not in `endpoints` (the registered ones):
        a retired or removed worker's subscriber would otherwise stay open for the router's life,
        one per worker a rollout or the controller ever replaced, and its blocks stay indexed."""
        for ep in [e for e in list(self._wanted) if e not in endpoints]:
            self._wanted.pop(ep, None)
            self._vllm.pop(ep, None)
            self._instances.pop(ep, None)
            self._dropped[ep] = self._names.pop(ep, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            for ep in list(self._dropped):
                name = self._dropped.pop(ep, None)
                if ep in self._wanted:  # followed again meanwhile
                    continue
                self._unsubscribe(ep)
                if name:
                    with self.lock:
                        self.index.remove_worker(name)
            for ep in list(self._renewed):
                self._renewed.discard(ep)
                self._unsubscribe(ep)
            for ep, snap in list(self._wanted.items()):
                if ep not in self._subs:
                    name = self._vllm.get(ep)
                    try:
                        self._subs[ep] = (
                            VLLMEventSubscriber(ep, snap, name, rehash=self.rehash)
                            if name is not None
                            else KVEventSubscriber(ep, snap, token=self.token)
                        )
                    except zmq.ZMQError as e:  # an endpoint ZMQ cannot connect to: the others go on
                        log.warning("KV events from %s: %s; not following them", ep, e)
                        self._wanted.pop(ep, None)
            busy = False
            for ep, sub in list(self._subs.items()):
                try:
                    busy |= self._update(ep, sub)
                except (TimeoutError, OSError, ValueError) as e:
                    log.debug("KV events from %s: %s", ep, e)
            if not busy:
                time.sleep(0.01)
        for sub in self._subs.values():
            sub.close()

    def _unsubscribe(self, ep: str) -> None:
        """Close `ep`'s subscriber and forget its snapshot retry (kv-index thread)."""
        old = self._subs.pop(ep, None)
        if old is not None:
            old.close()
        self._retry_at.pop(ep, None)

    def _update(self, ep: str, sub: KVEventSubscriber | VLLMEventSubscriber) -> bool:
        """Apply `sub`'s new events, then a snapshot when the index lacks or lost its worker's state."""
        events = sub.poll()
        if events:
            with self.lock:
                for ev in events:
                    if isinstance(ev, KVSnapshot):  # vLLM's format: the worker's blocks were cleared
                        self.index.apply_snapshot(ev)
                    else:
                        self.index.apply(ev)
        if not isinstance(sub, KVEventSubscriber) or sub.snapshot_endpoint is None:
            return bool(events)
        with self.lock:
            wanted = sub.worker_id is None or sub.worker_id in self.index.needs_snapshot
        now = time.monotonic()
        if wanted and now >= self._retry_at.get(ep, 0.0):
            self._retry_at[ep] = now + SNAPSHOT_RETRY_S  # cleared on success; a silent worker waits
            snap = sub.snapshot(SNAPSHOT_TIMEOUT_S)
            with self.lock:
                self.index.apply_snapshot(snap)
            self._retry_at.pop(ep, None)
        return bool(events)

    def match(self, hashes: list[bytes], registry) -> dict[str, tuple[int, str]]:
        """Cached leading blocks per registry worker id (the index knows workers by their own names)."""
        if not hashes:
            return {}
        with self.lock:
            found = self.index.match(hashes)
        by_name = {w.health.worker_id: w.worker_id for w in registry.workers.values() if w.health}
        return {by_name[name]: hit for name, hit in found.items() if name in by_name}

    def block_sizes(self) -> dict[str, int]:
        """Worker name -> its block size, learnt from its events (vLLM format with rehash)."""
        out = {}
        for ep, sub in list(self._subs.items()):
            bs = getattr(sub, "block_size", None)
            if bs and (name := self._vllm.get(ep)):
                out[name] = bs
        return out

    def blocks_of(self, name: str | None) -> int:
        """How many blocks the index holds for a worker (by its own name)."""
        if not name:
            return 0
        with self.lock:
            return len(self.index.worker_blocks(name))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
