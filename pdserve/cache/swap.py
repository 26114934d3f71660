"""Swap space: a preempted request's KV, parked in host RAM until it resumes.

On preemption (scheduler.py) the request's computed blocks, the partial last one included (the
prefix cache never holds that one), are copied out here and its device blocks are freed; on
resume it gets blocks again (its leading full blocks may still be cached on the device: those
are shared, not copied) and the rest is copied back, so nothing is recomputed. A request that
does not fit in the budget is recomputed as before.

Its own budget (`cache.swap_space_gb`), apart from the host tier: a swapped copy is the only
copy of that KV (the host tier may drop or spill what it holds at any time), and it is needed by
one request, not shared by hash. Memory is taken per swapped request and given back at once.
The copies are synchronous, one gather or scatter per request: a few MB, well under a decode step.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch


class Request(Protocol):
    """What swapping reads of a request (engine/request.py's Request; the cache sits below the engine)."""

    @property
    def request_id(self) -> str: ...
    @property
    def block_ids(self) -> list[int]: ...


class SwapSpace:
    def __init__(self, kv_cache: torch.Tensor, block_size: int, budget_bytes: int) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.budget_bytes = int(budget_bytes)
        self.block_bytes = kv_cache[:, :, :block_size].numel() * kv_cache.element_size()
        # Pinned host memory makes the device<->host copies DMA; plain memory on CPU.
        self._pin = kv_cache.device.type == "cuda"
        self._held: dict[str, torch.Tensor] = {}  # request id -> [layers, 2, blocks * block_size, heads, dim]
        self.used_bytes = 0
        self.counters = {
            "swapped_out_total": 0,
            "swapped_in_total": 0,
            "swap_fallbacks_total": 0,
            "swap_discarded_total": 0,
            "swap_out_blocks_total": 0,
            "swap_in_blocks_total": 0,
            "swap_seconds_total": 0.0,
        }

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        bs = self.block_size
        ids = torch.tensor(block_ids, dtype=torch.long)
        return (ids[:, None] * bs + torch.arange(bs)).flatten().to(self.kv_cache.device)

    def swap_out(self, req: Request, num_blocks: int) -> bool:
        """Copy the request's first `num_blocks` blocks out; False (nothing kept) when they do not fit."""
        size = num_blocks * self.block_bytes
        if num_blocks <= 0 or req.request_id in self._held or self.used_bytes + size > self.budget_bytes:
            self.counters["swap_fallbacks_total"] += 1
            return False
        t0 = time.perf_counter()
        data = self.kv_cache.index_select(2, self._slots(req.block_ids[:num_blocks]))
        if data.device.type != "cpu":
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=self._pin)
            data = host.copy_(data)
        self._held[req.request_id] = data
        self.used_bytes += size
        self.counters["swapped_out_total"] += 1
        self.counters["swap_out_blocks_total"] += num_blocks
        self.counters["swap_seconds_total"] += time.perf_counter() - t0
        return True

    def swap_in(self, req: Request, first: int) -> None:
        """Copy blocks `first`.. of the swapped KV into req.block_ids[first:] (the leading ones came
        from the prefix cache) and give the memory back."""
        t0 = time.perf_counter()
        data = self._release(req)
        bs = self.block_size
        n = data.shape[2] // bs
        if first < n:
            src = data[:, :, first * bs :].to(self.kv_cache.device)
            self.kv_cache.index_copy_(2, self._slots(req.block_ids[first:n]), src)
        self.counters["swapped_in_total"] += 1
        self.counters["swap_in_blocks_total"] += n - first
        self.counters["swap_seconds_total"] += time.perf_counter() - t0

    def discard(self, req: Request) -> None:
        """The request ended while swapped out (abort, error): drop its KV."""
        if req.request_id in self._held:
            self._release(req)
            self.counters["swap_discarded_total"] += 1

    def _release(self, req: Request) -> torch.Tensor:
        data = self._held.pop(req.request_id)
        self.used_bytes -= data.shape[2] // self.block_size * self.block_bytes
        return data

    def stats(self) -> dict[str, float]:
        return {
            **self.counters,
            "swap_used_bytes": float(self.used_bytes),
            "swapped_requests": len(self._held),
        }
