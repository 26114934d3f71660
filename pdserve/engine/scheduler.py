"""Continuous batching with chunked prefill: decisions only, no tensors.

Each step, running requests are served first in arrival order (FCFS), each taking what it still
needs to compute (one token when decoding, a chunk of the prompt otherwise) out of a per-step
token budget. Blocks are allocated for exactly the tokens scheduled. When the pool runs dry the
most recently admitted running request is preempted: its blocks are freed and it goes back to
the head of the queue to be recomputed. Waiting requests are admitted strictly in order while
the cap on running requests, the budget and the free blocks (minus a watermark) allow.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.cache.block_pool import BlockPool
from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledStep:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)   # (request, tokens to compute)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: BlockPool, block_size: int) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, req: Request, budget: int, nothing_scheduled: bool) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        if self.cfg.enable_chunked_prefill:
            return min(remaining, budget)
        # Without chunking a prompt goes whole; an oversized one runs alone in its step.
        return remaining if remaining <= budget or nothing_scheduled else 0

    def _grow(self, req: Request, num_new: int) -> bool:
        need = blocks_needed(req.num_computed_tokens + num_new, self.block_size) - len(req.block_ids)
        if need > self.pool.num_free:
            return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []

    def _preempt(self, req: Request, step: ScheduledStep) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.cfg.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        for req in list(self.running):
            if req not in self.running:     # preempted earlier in this loop
                continue
            num_new = self._chunk(req, budget, not step.scheduled)
            if num_new <= 0:
                continue
            while not self._grow(req, num_new):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled_ids), None)
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            step.scheduled.append((req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
        if step.preempted:
            return step
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            num_new = self._chunk(req, budget, not step.scheduled)
            if num_new <= 0:
                break
            need = blocks_needed(num_new, self.block_size) - len(req.block_ids)
            if need + self.cfg.watermark_blocks > self.pool.num_free and self.running:
                break
            if not self._grow(req, num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.scheduled.append((req, num_new))
            budget -= num_new
        return step

    def finish(self, req: Request, reason: str) -> None:
        """Free a request's blocks on every path: stop, length, abort."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
