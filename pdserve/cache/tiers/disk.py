"""Disk tier: one file per block, <dir>/<first 2 hex>/<hash hex>.kv, LRU under a byte budget.

Writes go to a temp file in the same directory and are renamed into place, so a reader (or a
restarted worker) sees a whole file or none. No fsync: a block torn by a power cut fails its
checksum and is dropped, which costs a recompute, never a wrong token. The index (sizes, LRU
order) lives in memory and is rebuilt from the directory at start, oldest mtime first.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.cache.tiers.codec import CorruptBlock, decode_block
from pdserve.cache.tiers.stats import TierStats

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"

# on_remove(hashes): blocks that left the tier (evicted, corrupt or gone).
RemoveFn = Callable[[list[bytes]], None]


class DiskTier:
    def __init__(
        self,
        directory: str | os.PathLike,
        budget_bytes: int,
        on_remove: RemoveFn | None = None,
        key: bytes | None = None,
    ) -> None:
        """`key`: the blocks' checksum key (codec.py), the same that wrote them."""
        self.directory = Path(directory)
        self.mac_key = key
        self.budget_bytes = int(budget_bytes)
        self.on_remove = on_remove
        self.stats = TierStats()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> size, LRU first
        self._used = 0
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._scan()

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    @property
    def used_bytes(self) -> int:
        return self._used

    def keys(self) -> list[bytes]:
        """LRU first."""
        with self._lock:
            return list(self._files)

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + _SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for sub in self.directory.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                try:
                    if f.name.startswith(_TMP_PREFIX):  # a write cut short by a crash
                        f.unlink()
                        continue
                    if f.suffix != _SUFFIX:
                        continue
                    h = bytes.fromhex(f.stem)
                    st = f.stat()
                except (OSError, ValueError):
                    continue
                found.append((st.st_mtime, h, st.st_size))
        found.sort()
        for _, h, size in found:
            self._files[h] = size
            self._used += size
        self._evict_over_budget()

    def put(self, block_hash: bytes, data: bytes) -> bool:
        """Store codec bytes. True when the block is (now) on disk."""
        if len(data) > self.budget_bytes:
            return False
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
                return True
        target = self.path(block_hash)
        tmp_name = None
        try:
            target.parent.mkdir(exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=target.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp_name, target)
        except OSError as e:
            log.warning("disk tier: writing %s failed: %s", target, e)
            self.stats.add(errors=1)
            if tmp_name is not None:
                try:
                    os.unlink(tmp_name)
                except OSError:
                    pass
            return False
        with self._lock:
            old = self._files.pop(block_hash, None)
            self._used += len(data) - (old or 0)
            self._files[block_hash] = len(data)
        self.stats.add(bytes_written=len(data))
        self._evict_over_budget()
        return True

    def get(
        self, block_hash: bytes, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor | None:
        """The verified block, or None: absent, unreadable or corrupt (then the file is deleted)."""
        with self._lock:
            known = block_hash in self._files
            if known:
                self._files.move_to_end(block_hash)
        if not known:
            self.stats.add(misses=1)
            return None
        t0 = time.perf_counter()
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
            block = decode_block(data, block_hash, shape=shape, dtype=dtype, key=self.mac_key)
        except FileNotFoundError:
            self.stats.add(misses=1, errors=1)
            self._forget(block_hash)
            return None
        except (OSError, CorruptBlock) as e:
            log.warning("disk tier: dropping %s: %s", path, e)
            self.stats.add(misses=1, corrupt=1)
            self.remove(block_hash)
            return None
        try:
            os.utime(path)  # keeps the LRU order for a restarted worker
        except OSError:
            pass
        self.stats.add(hits=1, bytes_read=len(data), load_seconds_sum=time.perf_counter() - t0, load_count=1)
        return block

    def remove(self, block_hash: bytes) -> None:
        try:
            self.path(block_hash).unlink()
        except OSError:
            pass
        self._forget(block_hash)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is None:
                return
            self._used -= size
        if self.on_remove is not None:
            self.on_remove([block_hash])

    def _evict_over_budget(self) -> None:
        evicted: list[bytes] = []
        with self._lock:
            while self._used > self.budget_bytes and self._files:
                h, size = self._files.popitem(last=False)
                self._used -= size
                evicted.append(h)
        for h in evicted:
            try:
                self.path(h).unlink()
            except OSError:
                pass
        if evicted:
            self.stats.add(evictions=len(evicted))
            if self.on_remove is not None:
                self.on_remove(evicted)
