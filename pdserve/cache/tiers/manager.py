"""TieredKVStore: the KV blocks the device pool evicted, kept in host RAM -> disk -> remote (Redis).

Write policy:
- offload() copies the block to host RAM on the calling thread (the device block is reused right
  after) and returns; nothing slower runs on the engine thread.
- host -> disk is write-back: a block reaches disk when the host tier evicts it. Until the writer
  thread has written it, it stays readable from a pending map, so it is never in no tier at all.
- remote is write-through: every offloaded block is also queued for Redis at once, so other
  workers can reuse it while this one still holds it. Blocks this store wrote or read recently
  are not uploaded again (a bounded memory of keys; Redis may still evict them).
- Writes are best effort: past `max_pending_bytes` queued, a write is dropped and counted.

Loads run on one loader thread, block by block, from the fastest tier holding each block; the
first block that is missing or fails verification ends the load, and on_done gets the length of
the prefix that loaded, so the caller recomputes the rest and never decodes from wrong KV.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.cache.tiers.codec import encode_block
from pdserve.cache.tiers.disk import DiskTier
from pdserve.cache.tiers.host import HostTier
from pdserve.cache.tiers.redis_tier import RedisTier
from pdserve.config import CacheConfig

log = logging.getLogger(__name__)

# listener(kind, hashes, tier): kind "stored" | "removed", tier "host" | "disk" | "remote".
# Called from the engine thread and the store's threads; remote removals (TTL, Redis eviction)
# are not observed, so "removed" never comes for "remote".
TierListener = Callable[[str, list[bytes], str], None]
DoneFn = Callable[[int], None]

_REMEMBER_REMOTE = 1 << 16


@dataclass
class _Load:
    hashes: list[bytes]
    block_ids: list[int]
    kv: torch.Tensor
    on_done: DoneFn
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    finished: bool = False


class TieredKVStore:
    def __init__(
        self,
        block_size: int,
        *,
        host_bytes: int = 0,
        disk_dir: str | Path | None = None,
        disk_bytes: int = 0,
        remote: str | None = None,
        remote_ttl_s: int | None = None,
        namespace: str | None = None,
        load_timeout_s: float = 5.0,
        listener: TierListener | None = None,
        max_pending_bytes: int = 256 << 20,
        key: bytes | None = None,
    ) -> None:
        """`namespace` (engine/tier_identity.py) keeps caches of different models apart on a shared
        disk or Redis: block hashes cover token ids only. `key` keys the blocks' checksum (codec.py)."""
        self.mac_key = key
        self.block_size = block_size
        self.load_timeout_s = load_timeout_s  # default deadline of load_async
        self.listener = listener
        self.max_pending_bytes = max_pending_bytes
        self.host = HostTier(host_bytes, self._spill) if host_bytes > 0 else None
        self.disk = None
        if disk_dir is not None and disk_bytes > 0:
            d = Path(disk_dir) / namespace if namespace else Path(disk_dir)
            self.disk = DiskTier(d, disk_bytes, lambda hs: self._emit("removed", hs, "disk"), key=key)
        self.remote = RedisTier(remote, ttl_s=remote_ttl_s, namespace=namespace, key=key) if remote else None
        self._lock = threading.Lock()
        self._pending: dict[bytes, torch.Tensor] = {}  # left host, not yet on disk
        self._queued_bytes = 0
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._remote_known: OrderedDict[bytes, None] = OrderedDict()
        self._counts = dict.fromkeys(
            (
                "offloads",
                "write_drops",
                "pending_hits",
                "loads",
                "loads_cancelled",
                "loads_timed_out",
                "blocks_loaded",
                "blocks_failed",
            ),
            0,
        )
        self._loads: dict[int, _Load] = {}
        self._tickets = itertools.count(1)
        self._writes: queue.Queue = queue.Queue()
        self._load_queue: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True),
            threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True),
        ]
        for t in self._threads:
            t.start()
        if self.disk is not None and len(self.disk):  # a restarted worker announces what it kept
            self._emit("stored", self.disk.keys(), "disk")

    @classmethod
    def from_config(
        cls,
        cc: CacheConfig,
        *,
        namespace: str | None = None,
        key: bytes | None = None,
        listener: TierListener | None = None,
    ) -> TieredKVStore | None:
        """None when every tier is off."""
        host = int(cc.host_cache_gb * (1 << 30))
        disk = int(cc.disk_cache_gb * (1 << 30)) if cc.disk_cache_dir else 0
        if not (host or disk or cc.remote):
            return None
        return cls(
            cc.block_size,
            host_bytes=host,
            disk_dir=cc.disk_cache_dir,
            disk_bytes=disk,
            remote=cc.remote,
            remote_ttl_s=cc.remote_ttl_s,
            namespace=namespace,
            load_timeout_s=cc.load_timeout_s,
            listener=listener,
            key=key,
        )

    # ------------------------------------------------------------------ offload (engine thread)

    def offload(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Keep a copy of one evicted block's KV ([layers, 2, block_size, kv_heads, head_dim])."""
        try:
            self._offload(block_hash, block)
        except Exception:  # a cache must never take the engine down
            log.exception("offloading block %s failed", block_hash.hex())

    def _offload(self, h: bytes, block: torch.Tensor) -> None:
        if self.host is not None and self.host.touch(h):
            return
        with self._lock:
            if h in self._pending:
                return
        if (
            self.host is None
            and (self.disk is None or h in self.disk)
            and (self.remote is None or h in self._remote_known)
        ):
            return
        copy = torch.empty(block.shape, dtype=block.dtype, device="cpu")
        copy.copy_(block)
        self._count("offloads")
        to_remote = self.remote is not None and h not in self._remote_known
        if self.host is not None and self.host.put(h, copy):
            self._emit("stored", [h], "host")
            self._enqueue(h, copy, to_disk=False, to_remote=to_remote)
        else:  # no host tier, or a block bigger than all of it
            self._enqueue(h, copy, to_disk=self.disk is not None and h not in self.disk, to_remote=to_remote)

    def _spill(self, h: bytes, block: torch.Tensor) -> None:
        """The host tier evicted `h`: on to disk (remote has it already, write-through)."""
        self._emit("removed", [h], "host")
        if self.disk is not None and h not in self.disk:
            self._enqueue(h, block, to_disk=True, to_remote=False)

    def _enqueue(self, h: bytes, block: torch.Tensor, *, to_disk: bool, to_remote: bool) -> None:
        if not (to_disk or to_remote):
            return
        size = block.numel() * block.element_size()
        with self._lock:
            if self._queued_bytes + size > self.max_pending_bytes:
                self._counts["write_drops"] += 1
                return
            self._queued_bytes += size
            self._in_flight += 1
            if to_disk:
                self._pending[h] = block
        self._writes.put((h, block, to_disk, to_remote))

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            h, block, to_disk, to_remote = job
            try:
                data = None
                if to_disk and self.disk is not None and h not in self.disk:
                    data = encode_block(h, block, self.mac_key)
                    if self.disk.put(h, data):
                        self._emit("stored", [h], "disk")
                if to_remote and self.remote is not None:
                    data = data if data is not None else encode_block(h, block, self.mac_key)
                    if self.remote.put(h, data):
                        self._remember_remote(h)
                        self._emit("stored", [h], "remote")
            except Exception:
                log.exception("writing block %s to a lower tier failed", h.hex())
            finally:
                with self._lock:
                    if to_disk and self._pending.get(h) is block:
                        del self._pending[h]
                    self._queued_bytes -= block.numel() * block.element_size()
                    self._in_flight -= 1
                    self._idle.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done (tests, shutdown). False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    # ------------------------------------------------------------------ lookup (engine thread)

    def _has_local(self, h: bytes) -> bool:
        return (
            (self.host is not None and h in self.host)
            or h in self._pending
            or (self.disk is not None and h in self.disk)
        )

    def lookup(self, hashes: list[bytes], *, remote: bool = True) -> int:
        """How many leading `hashes` some tier holds. Moves no data; Redis costs one round trip."""
        n = 0
        while n < len(hashes) and self._has_local(hashes[n]):
            n += 1
        if n == len(hashes) or not remote or self.remote is None:
            return n
        rest = hashes[n:]
        for h, there in zip(rest, self.remote.exists_many(rest)):
            if not (there or self._has_local(h)):
                break
            n += 1
        return n

    # ------------------------------------------------------------------ loads (loader thread)

    def load_async(
        self,
        hashes: list[bytes],
        block_ids: list[int],
        kv: torch.Tensor,
        on_done: DoneFn,
        timeout: float | None = None,
    ) -> int:
        """Copy the blocks named by `hashes` into `kv` at `block_ids`, in the background; then
        on_done(n), n = how many leading blocks loaded and verified, called on the loader thread.
        No block is started after `timeout` (default load_timeout_s, queueing included), so
        on_done comes at most one block fetch later. Returns a ticket for cancel()."""
        if len(hashes) != len(block_ids):
            raise ValueError("one block id per hash")
        ticket = next(self._tickets)
        deadline = time.monotonic() + (self.load_timeout_s if timeout is None else timeout)
        job = _Load(list(hashes), list(block_ids), kv, on_done, deadline)
        with self._lock:
            self._loads[ticket] = job
        self._load_queue.put(ticket)
        return ticket

    def cancel(self, ticket: int) -> bool:
        """True: on_done will not be called, and no block is written into kv after this returns
        (the caller may free the blocks). False: the load finished; on_done ran or is running."""
        with self._lock:
            job = self._loads.get(ticket)
        if job is None:
            return False
        with job.lock:
            if job.finished:
                return False
            job.cancelled = True
        self._count("loads_cancelled")
        return True

    def _fetch(self, h: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if self.host is not None:
            t = self.host.get(h)
            if t is not None and tuple(t.shape) == shape and t.dtype == dtype:
                return t
        with self._lock:
            t = self._pending.get(h)
        if t is not None and tuple(t.shape) == shape and t.dtype == dtype:
            self._count("pending_hits")
            return t
        if self.disk is not None:
            t = self.disk.get(h, shape=shape, dtype=dtype)
            if t is not None:
                return t
        if self.remote is not None:
            t = self.remote.get(h, shape=shape, dtype=dtype)
            if t is not None:
                self._remember_remote(h)
                return t
        return None

    def _run_load(self, job: _Load) -> None:
        bs = self.block_size
        shape = (job.kv.shape[0], job.kv.shape[1], bs, *job.kv.shape[3:])
        n = 0
        for h, b in zip(job.hashes, job.block_ids):
            if job.cancelled:
                return
            if time.monotonic() >= job.deadline:
                self._count("loads_timed_out")
                break
            block = self._fetch(h, shape, job.kv.dtype)
            if block is None:
                self._count("blocks_failed")
                break
            with job.lock:
                if job.cancelled:
                    return
                job.kv[:, :, b * bs : (b + 1) * bs].copy_(block)
            n += 1
        with job.lock:
            if job.cancelled:
                return
            job.finished = True
        self._count("loads")
        self._count("blocks_loaded", n)
        job.on_done(n)

    def _load_loop(self) -> None:
        while (ticket := self._load_queue.get()) is not None:
            with self._lock:
                job = self._loads.get(ticket)
            try:
                if job is not None:
                    self._run_load(job)
            except Exception:
                log.exception("loading KV blocks failed")
                with job.lock:
                    call = not job.cancelled and not job.finished
                    job.finished = True
                if call:  # the blocks written so far may be partial: report none
                    job.on_done(0)
            finally:
                with self._lock:
                    self._loads.pop(ticket, None)

    # ------------------------------------------------------------------ bookkeeping

    def _remember_remote(self, h: bytes) -> None:
        with self._lock:
            self._remote_known[h] = None
            self._remote_known.move_to_end(h)
            if len(self._remote_known) > _REMEMBER_REMOTE:
                self._remote_known.popitem(last=False)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _emit(self, kind: str, hashes: list[bytes], tier: str) -> None:
        if self.listener is not None and hashes:
            try:
                self.listener(kind, hashes, tier)
            except Exception:
                log.exception("KV tier listener failed")

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, tier in (("host", self.host), ("disk", self.disk), ("remote", self.remote)):
            if tier is not None:
                out.update(tier.stats.as_dict(f"tier_{name}_"))
        if self.host is not None:
            out["tier_host_blocks"] = float(len(self.host))
            out["tier_host_used_bytes"] = float(self.host.used_bytes)
        if self.disk is not None:
            out["tier_disk_blocks"] = float(len(self.disk))
            out["tier_disk_used_bytes"] = float(self.disk.used_bytes)
        with self._lock:
            out.update({f"tier_{k}": float(v) for k, v in self._counts.items()})
            out["tier_pending_blocks"] = float(len(self._pending))
            out["tier_queued_bytes"] = float(self._queued_bytes)
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes and loads, then stop the threads."""
        self._writes.put(None)
        self._load_queue.put(None)
        for t in self._threads:
            t.join(timeout)
        if self.remote is not None:
            self.remote.close()
