"""A fixed pool of KV block ids with reference counts. Holds no tensors (see kv_cache.py)."""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
