"""A fixed pool of KV block ids with reference counts. Holds no tensors (see kv_cache.py).

With a prefix cache attached, a cached block whose last reference goes away is not freed: it
stays evictable, and allocation evicts such blocks (LRU leaves first) once the free list is empty.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pdserve.cache.prefix_cache import PrefixCache


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks
        # Told of every allocation (blocks about to get new contents), e.g. by expert-parallel ranks
        # whose copies of those blocks go stale (model/ep_kv.py).
        self.on_allocate: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: free ones plus unreferenced cached ones."""
        cached = self.prefix_cache.num_unreferenced if self.prefix_cache else 0
        return len(self._free) + cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} available")
        while len(self._free) < n:
            evicted = self.prefix_cache.evict_one() if self.prefix_cache else None
            if evicted is None:  # unreferenced cached blocks that are not leaves cannot go first
                raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free after eviction")
            self._free.append(evicted)
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        if self.on_allocate is not None:
            self.on_allocate(blocks)
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Take a reference; cached unreferenced blocks come back into use (prefix hits)."""
        for b in blocks:
            if self._refcount[b] == 0:
                if not (self.prefix_cache and self.prefix_cache.is_cached(b)):
                    raise ValueError(f"block {b} is not allocated")
                self.prefix_cache.on_referenced(b)
            self._refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if self.prefix_cache and self.prefix_cache.is_cached(b):
                    self.prefix_cache.on_unreferenced(b)
                else:
                    self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert all(self._refcount[b] == 0 for b in free), "a free block is referenced"
        if self.prefix_cache is not None:
            cached = set(self.prefix_cache.hash_of)
            assert not (free & cached), "a free block is still cached"
            self.prefix_cache.check_integrity(self._refcount)
            idle = {b for b in range(self.num_blocks) if self._refcount[b] == 0}
            assert idle == free | self.prefix_cache.unreferenced, "a block is neither used, cached nor free"
        else:
            assert sum(1 for r in self._refcount if r == 0) == len(free), "a block leaked"
