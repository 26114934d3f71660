"""Feeds the router's global KV index from the workers' KV events (a thread owning the ZMQ sockets).

Workers report their event endpoints in /health; the feed subscribes to each one it sees, takes a
snapshot first (so a restarted router rebuilds the index), then applies events.
"""
from __future__ import annotations

import logging
import threading
import time

from pdserve.cache.kv_events import KVEventSubscriber
from pdserve.cache.kv_index import KVIndex

log = logging.getLogger(__name__)


class IndexFeed:
    def __init__(self) -> None:
        self.index = KVIndex()
        self.lock = threading.Lock()
        self._subs: dict[str, KVEventSubscriber] = {}      # event endpoint -> subscriber
        self._wanted: dict[str, str | None] = {}           # event endpoint -> snapshot endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)
        self._thread.start()

    def watch(self, endpoint: str | None, snapshot_endpoint: str | None) -> None:
        if endpoint and endpoint not in self._wanted:
            self._wanted[endpoint] = snapshot_endpoint

    def _run(self) -> None:
        while not self._stop.is_set():
            for ep, snap in list(self._wanted.items()):
                if ep not in self._subs:
                    self._subs[ep] = KVEventSubscriber(ep, snap)
            busy = False
            for ep, sub in list(self._subs.items()):
                try:
                    with self.lock:
                        busy |= sub.update(self.index) > 0
                except (TimeoutError, OSError) as e:
                    log.debug("KV events from %s: %s", ep, e)
            if not busy:
                time.sleep(0.01)
        for sub in self._subs.values():
            sub.close()

    def match(self, hashes: list[bytes], registry) -> dict[str, tuple[int, str]]:
        """Cached leading blocks per registry worker id (the index knows workers by their own names)."""
        if not hashes:
            return {}
        with self.lock:
            found = self.index.match(hashes)
        by_name = {w.health.worker_id: w.worker_id for w in registry.workers.values() if w.health}
        return {by_name[name]: hit for name, hit in found.items() if name in by_name}

    def blocks_of(self, name: str | None) -> int:
        """How many blocks the index holds for a worker (by its own name)."""
        if not name:
            return 0
        with self.lock:
            return len(self.index.worker_blocks(name))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
