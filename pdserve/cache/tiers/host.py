"""Host RAM tier: an LRU of block tensors under a byte budget; what falls out goes to the next tier."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from pdserve.cache.tiers.stats import TierStats

# spill(block_hash, tensor): called once per evicted entry, outside the tier's lock.
SpillFn = Callable[[bytes, torch.Tensor], None]


class HostTier:
    def __init__(self, budget_bytes: int, spill: SpillFn | None = None) -> None:
        self.budget_bytes = int(budget_bytes)
        self.spill = spill
        self.stats = TierStats()
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU first
        self._used = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    @property
    def used_bytes(self) -> int:
        return self._used

    def keys(self) -> list[bytes]:
        """LRU first."""
        with self._lock:
            return list(self._blocks)

    def touch(self, block_hash: bytes) -> bool:
        """Mark as most recently used; False when absent."""
        with self._lock:
            if block_hash not in self._blocks:
                return False
            self._blocks.move_to_end(block_hash)
            return True

    def put(self, block_hash: bytes, block: torch.Tensor) -> bool:
        """Keep `block` (the caller hands over ownership: no copy). False, and nothing kept or
        spilled, when it is bigger than the whole budget: the caller decides where it goes."""
        size = block.numel() * block.element_size()
        if size > self.budget_bytes:
            return False
        evicted: list[tuple[bytes, torch.Tensor]] = []
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self._used -= old.numel() * old.element_size()
            self._blocks[block_hash] = block
            self._used += size
            while self._used > self.budget_bytes:
                h, t = self._blocks.popitem(last=False)
                self._used -= t.numel() * t.element_size()
                evicted.append((h, t))
        self.stats.add(bytes_written=size, evictions=len(evicted))
        if self.spill is not None:
            for h, t in evicted:
                self.spill(h, t)
        return True

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        t0 = time.perf_counter()
        with self._lock:
            block = self._blocks.get(block_hash)
            if block is not None:
                self._blocks.move_to_end(block_hash)
        if block is None:
            self.stats.add(misses=1)
            return None
        self.stats.add(
            hits=1,
            bytes_read=block.numel() * block.element_size(),
            load_seconds_sum=time.perf_counter() - t0,
            load_count=1,
        )
        return block

    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        with self._lock:
            block = self._blocks.pop(block_hash, None)
            if block is not None:
                self._used -= block.numel() * block.element_size()
            return block
