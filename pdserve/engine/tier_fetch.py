"""The engine's side of the tiered KV cache: offload evicted device blocks, prefetch tier hits.

The scheduler admits a request whose next blocks sit in a lower tier as `loading`, with blocks
for that stretch (`ScheduledStep.to_fetch`). `start` hands them to the store's loader thread;
its on_done(n) only posts to a queue, and `poll` (start of each engine step, engine thread)
applies results: the first n blocks hold verified KV, the rest are recomputed. Every block and
every scheduler change stays on the engine thread.

A load past `cache.load_timeout_s` is cancelled and recomputed. An aborted request's load is
cancelled; whatever `cancel` answers, the loader writes nothing into those blocks afterwards
(True: it stopped before the next block; False: it had already finished), so they can be freed
at once, and a result that still arrives for them is recognised as stale and dropped.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.cache.tiers.manager import TieredKVStore

if TYPE_CHECKING:
    from pdserve.engine.request import Request

log = logging.getLogger(__name__)

# Store gauges; every other key of TieredKVStore.stats() only grows and is exported as a counter.
_GAUGES = {
    "tier_host_blocks",
    "tier_host_used_bytes",
    "tier_disk_blocks",
    "tier_disk_used_bytes",
    "tier_pending_blocks",
    "tier_queued_bytes",
}


def _metric_name(key: str) -> str:
    if key in _GAUGES:
        return key
    key = key.replace("_load_seconds_sum", "_load_seconds").replace("_load_count", "_reads")
    return key + "_total"


@dataclass(eq=False)
class _Fetch:
    req: Request
    num_blocks: int
    started: float
    deadline: float
    ticket: int = 0


class TierFetcher:
    def __init__(
        self, store: TieredKVStore, kv_cache: torch.Tensor, block_size: int, timeout_s: float
    ) -> None:
        self.store = store
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.clock = time.monotonic  # the engine's deadlines run on this (tests pass their own)
        self.loads: dict[str, _Fetch] = {}  # engine thread only
        self._results: queue.SimpleQueue[tuple[_Fetch, int]] = queue.SimpleQueue()
        self._event = threading.Event()
        self.counters = {
            "tier_fetch_requests_total": 0,
            "tier_fetch_blocks_total": 0,
            "tier_fetched_tokens_total": 0,
            "tier_fetch_fallbacks_total": 0,
            "tier_fetch_seconds_total": 0.0,
        }

    # ------------------------------------------------------------------ engine thread

    def offload(self, block_id: int, block_hash: bytes) -> None:
        """PrefixCache.on_evict: the block's KV is intact now and overwritten soon after; the store copies it."""
        bs = self.block_size
        self.store.offload(block_hash, self.kv_cache[:, :, block_id * bs : (block_id + 1) * bs])

    def lookup(self, hashes: list[bytes]) -> int:
        return self.store.lookup(hashes)

    def start(self, req: Request) -> None:
        """`req` holds its device hit, then blocks for the stretch lower tiers hold: fill those."""
        first = req.num_cached_blocks
        blocks = req.block_ids[first:]
        now = self.clock()
        rec = _Fetch(req, len(blocks), now, now + self.timeout_s)
        self.loads[req.request_id] = rec
        self.counters["tier_fetch_requests_total"] += 1
        self.counters["tier_fetch_blocks_total"] += len(blocks)
        rec.ticket = self.store.load_async(
            req.block_hashes[first : first + len(blocks)],
            blocks,
            self.kv_cache,
            functools.partial(self._done, rec),
            self.timeout_s,
        )

    def poll(self) -> list[tuple[Request, int]]:
        """Finished loads as (request, blocks loaded), timed-out ones with 0."""
        out = []
        now = self.clock()
        while True:
            try:
                rec, n = self._results.get_nowait()
            except queue.Empty:
                break
            if self.loads.get(rec.req.request_id) is rec:  # else aborted or timed out already
                del self.loads[rec.req.request_id]
                out.append((rec.req, n))
                self._account(rec, n, now)
        for rid, rec in list(self.loads.items()):
            # False: the load finished and its result is on the way; take it next time.
            if now >= rec.deadline and self.store.cancel(rec.ticket):
                log.warning("tier load of %s timed out after %.1fs; recomputing", rid, now - rec.started)
                del self.loads[rid]
                out.append((rec.req, 0))
                self._account(rec, 0, now)
        return out

    def _account(self, rec: _Fetch, n: int, now: float) -> None:
        self.counters["tier_fetched_tokens_total"] += n * self.block_size
        self.counters["tier_fetch_seconds_total"] += now - rec.started
        if n < rec.num_blocks:
            self.counters["tier_fetch_fallbacks_total"] += 1

    def cancel(self, req: Request) -> bool:
        """`req` is leaving; True when it was loading from the tiers (its blocks may be freed now)."""
        rec = self.loads.pop(req.request_id, None)
        if rec is None:
            return False
        self.store.cancel(rec.ticket)
        return True

    def has_loads(self) -> bool:
        return bool(self.loads)

    def wait(self, timeout: float) -> None:
        """Nothing to compute: sleep until a load finishes or the timeout passes (no busy loop)."""
        self._event.wait(timeout)
        self._event.clear()

    def stats(self) -> dict[str, float]:
        out = {_metric_name(k): v for k, v in self.store.stats().items()}
        out.update(self.counters)
        out["tier_loading"] = len(self.loads)
        return out

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ loader thread

    def _done(self, rec: _Fetch, n: int) -> None:
        self._results.put((rec, n))
        self._event.set()
