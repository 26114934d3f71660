"""Continuous batching with chunked prefill: decisions only, no tensors.

Each step, running requests are served first in arrival order (FCFS), each taking what it still
needs to compute (one token when decoding, a chunk of the prompt otherwise) out of a per-step
token budget. Blocks are allocated for exactly the tokens scheduled. When the pool runs dry the
most recently admitted running request is preempted: its blocks are freed and it goes back to
the head of the queue. With swap space (cache/swap.py) and room in it, its computed KV is copied
to host RAM first and copied back when it is admitted again, so it resumes where it stopped;
otherwise it is recomputed (the prefix cache may still hold its leading blocks). Waiting requests are admitted strictly in order while
the cap on running requests, the budget and the free blocks allow; one test (`_fits`) decides every
admission, keeping a watermark of blocks back while any request runs or loads. The engine hands
each step it ran back to `update`, which advances the requests and caches their full blocks.

A decode worker with prefill peers admits a request whose uncached prompt is long enough as
`loading` instead: it gets blocks for the whole prompt, takes no compute budget, and joins the
running batch when a prefill worker has filled them (`finish_loading`), or goes back to the head
of the queue when that fails (`abandon_loading`).

With lower KV tiers (host RAM, disk, Redis), the blocks that follow a request's device prefix hit
are looked up there (`tier_lookup`); a request with such blocks is admitted as `loading` too, with
blocks for that stretch only, and once they are filled (`finish_fetch(req, n)`: the first n
arrived) it joins the running batch and prefills the rest like any other request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.prefix_cache import block_hash
from pdserve.common.images import block_extra
from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.cache.swap import SwapSpace


@dataclass
class ScheduledStep:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute)
    preempted: list[Request] = field(default_factory=list)
    to_load: list[Request] = field(default_factory=list)  # admitted as loading: their KV comes from a peer
    to_fetch: list[Request] = field(default_factory=list)  # admitted as loading: blocks come from lower tiers


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# _admit's answer for a request that waits while later ones may be admitted.
_PASSED = -1


def wants_remote_prefill(num_uncached: int, local_prefill_max_tokens: int | None, has_peer: bool) -> bool:
    """Conditional disaggregation: short uncached remainders are cheaper to prefill locally than to ship."""
    return has_peer and local_prefill_max_tokens is not None and num_uncached >= local_prefill_max_tokens


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        local_prefill_max_tokens: int | None = None,
        tier_lookup: Callable[[list[bytes]], int] | None = None,
        swap: SwapSpace | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.tier_lookup = tier_lookup  # how many leading block hashes lower tiers hold
        self.swap = swap  # host RAM for preempted requests' KV; None: always recompute
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        # VLM prompts: False while the request's images lack embeddings (engine/image_inputs.py).
        self.inputs_ready: Callable[[Request], bool] | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

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

    def _release(self, req: Request, held: list[int] | None = None) -> None:
        if req.block_ids:
            keep = set(held or ())
            self.pool.free([b for b in req.block_ids if b not in keep])
            req.block_ids = []
        req.num_cached_blocks = 0

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended (and kept) up to `num_blocks` full blocks."""
        bs = self.block_size
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            extra = block_extra(req.images, i * bs, (i + 1) * bs) if req.images else None
            req.block_hashes.append(
                block_hash(parent, req.all_token_ids[i * bs : (i + 1) * bs], req.salt_key, extra)
            )
        return req.block_hashes[:num_blocks]

    def _match_prefix(self, req: Request) -> list[int]:
        cache = self.pool.prefix_cache
        if cache is None or req.collects_prompt:
            return []
        # At least one token is always computed: its logits give the next token.
        return cache.match(self._hashes(req, (req.num_tokens - 1) // self.block_size))

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        cache = self.pool.prefix_cache
        if cache is None or getattr(req.kv_sink, "error", None):
            return  # a failed prefill job's KV may be incomplete (an earlier chunk's that never came)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        hashes = self._hashes(req, full)
        for i in range(req.num_cached_blocks, full):
            node = cache.nodes.get(hashes[i])
            parent = cache.nodes.get(hashes[i - 1]) if i else None
            if (node is not None and node.block_id != req.block_ids[i]) or (
                i and (parent is None or parent.block_id != req.block_ids[i - 1])
            ):
                # Another block holds this prefix (e.g. an earlier request's identical reply): the
                # chain diverged physically, and stays so for the blocks this request computes later,
                # so none is hung under a block it does not hold (every cached block's ancestors
                # stay referenced whenever it is, or the pool counts a block it cannot evict as free).
                break
            if node is None:
                bs = self.block_size  # the block's tokens: vLLM-format KV events carry them
                cache.insert(
                    hashes[i],
                    hashes[i - 1] if i else None,
                    req.block_ids[i],
                    req.all_token_ids[i * bs : (i + 1) * bs],
                )
        req.num_cached_blocks = full

    def _preempt(self, req: Request, step: ScheduledStep) -> None:
        self.running.remove(req)
        computed = req.num_computed_tokens
        # A prefill job's KV streams to its decode worker as it is computed: it recomputes, as before.
        swapped = (
            self.swap is not None
            and req.kv_sink is None
            and 0 < computed < req.num_tokens
            and self.swap.swap_out(req, blocks_needed(computed, self.block_size))
        )
        self._release(req)
        req.swapped_tokens = computed if swapped else 0
        if not swapped:
            req.recompute_until = max(req.recompute_until, computed)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self._schedule_running(step, self.cfg.max_num_batched_tokens)
        if not step.preempted:
            self._admit_waiting(step, budget)
        return step

    def update(self, step: ScheduledStep) -> tuple[int, int]:
        """Commit a step the model ran: each scheduled request's computed tokens advance and its newly
        full blocks enter the prefix cache. Returns the prompt positions computed (prefix-cache hits
        never get here) and those computed again after a preemption without swap."""
        prefill = recomputed = 0
        for req, n in step.scheduled:
            done = req.num_computed_tokens
            prefill += max(0, min(done + n, req.num_prompt_tokens) - done)
            recomputed += max(0, min(done + n, req.recompute_until) - done)
            req.num_computed_tokens = done + n
            self.cache_computed_blocks(req)
        return prefill, recomputed

    def _schedule_running(self, step: ScheduledStep, budget: int) -> int:
        """Running requests first, in arrival order; when the pool runs dry the most recently admitted
        one not yet scheduled is preempted. Returns the budget left."""
        scheduled_ids: set[str] = set()
        for req in list(self.running):
            if req not in self.running:  # preempted earlier in this loop
                continue
            num_new = self._chunk(req, budget, not step.scheduled)
            if num_new <= 0:
                continue
            if req.draft_tokens:  # a decode with drafts to verify: as many as the budget allows
                req.draft_tokens = req.draft_tokens[: max(0, budget - num_new)]
                num_new += len(req.draft_tokens)
            while not self._grow(req, num_new):
                # req itself is running and not yet scheduled: there is always a victim
                victim = next(r for r in reversed(self.running) if r.request_id not in scheduled_ids)
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            step.scheduled.append((req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
        return budget

    def _admit_waiting(self, step: ScheduledStep, budget: int) -> None:
        """Waiting requests, strictly in order, while the cap on requests, the budget and the blocks allow."""
        inflight = self._inflight_hashes()
        for req in list(self.waiting):
            if len(self.running) + len(self.loading) >= self.cfg.max_num_seqs:
                break
            taken = (
                self._resume(req, budget, step)
                if req.swapped_tokens
                else self._admit(req, budget, step, inflight)
            )
            if taken is None:
                break
            if taken is not _PASSED:
                budget -= taken
                self._mark_inflight(req, inflight)

    def _admit(self, req: Request, budget: int, step: ScheduledStep, inflight: set[bytes]) -> int | None:
        """Admit one waiting request: as loading (a prefill peer or lower tiers fill its blocks) or
        running. The tokens it takes from the budget; _PASSED: it waits, later ones may go; None:
        it does not fit, and nothing after it goes either."""
        hit = self._match_prefix(req)
        # A pipelined chunk's leading tokens are not computed here: their KV arrives in its first step.
        req.num_computed_tokens = max(len(hit) * self.block_size, req.upstream_tokens)
        if inflight and not req.collects_prompt and self._next_block_inflight(req, len(hit), inflight):
            # Another request is computing or loading this request's next block right now: wait
            # a step or two and hit the cache instead of computing or fetching it again.
            req.num_computed_tokens = 0
            return _PASSED
        fetch = self._tier_hit(req, len(hit))
        # A tier hit counts as cached when choosing a remote prefill; if one is still chosen, the
        # prefill worker uses its own caches and nothing is fetched here.
        uncached = req.num_tokens - req.num_computed_tokens - fetch * self.block_size
        # A request with outputs (migrated here, or preempted) goes too: the prefill worker
        # computes them with the prompt and samples the next output in sequence.
        # Prompt logprobs: the prefill worker computes them with the prompt (it takes no cache hit
        # for such a request either) and sends them with the first token.
        if wants_remote_prefill(uncached, self.local_prefill_max_tokens, bool(req.prefill_peers)):
            return 0 if self._admit_loading(req, hit, step) else None
        if req.images and self.inputs_ready is not None and not self.inputs_ready(req):
            req.num_computed_tokens = 0  # its images are being encoded
            return _PASSED
        if fetch and self._admit_fetch(req, hit, fetch, step):
            return 0
        num_new = self._chunk(req, budget, not step.scheduled) if budget > 0 else 0
        if num_new <= 0 or not self._take(
            req,
            hit,
            blocks_needed(req.num_computed_tokens + num_new, self.block_size) - len(hit),
            RequestStatus.RUNNING,
        ):
            req.num_computed_tokens = 0
            return None
        step.scheduled.append((req, num_new))
        return num_new

    def _resume(self, req: Request, budget: int, step: ScheduledStep) -> int | None:
        """Admit a swapped-out request: its leading full blocks still cached on the device are shared,
        fresh blocks take the rest of its swapped KV (copied back now), and it is scheduled from where
        it stopped. Tokens scheduled, or None, with nothing changed, when it does not fit yet."""
        bs, swapped = self.block_size, req.swapped_tokens
        assert self.swap is not None, "only swap_out sets swapped_tokens"
        hit = self._match_prefix(req)[: swapped // bs]
        req.num_computed_tokens = swapped
        num_new = self._chunk(req, budget, not step.scheduled) if budget > 0 else 0
        if num_new <= 0 or not self._fits(hit, blocks_needed(swapped + num_new, bs) - len(hit)):
            req.num_computed_tokens = 0
            return None
        self.pool.incref(hit)
        req.block_ids = list(hit) + self.pool.allocate(blocks_needed(swapped, bs) - len(hit))
        req.num_cached_blocks = len(hit)
        self.swap.swap_in(req, len(hit))
        req.swapped_tokens = 0
        self._grow(req, num_new)  # fits: counted in `need` above
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.scheduled.append((req, num_new))
        return num_new

    def _inflight_hashes(self) -> set[bytes]:
        """Hashes of the prompt blocks that running requests are computing, and loading requests
        are receiving (from a tier or a prefill peer), and that are not cached yet: a request
        that needs them next waits for them instead of computing or fetching them a second time."""
        out: set[bytes] = set()
        for r in (*self.running, *self.loading.values()):
            self._mark_inflight(r, out)
        return out

    def _mark_inflight(self, req: Request, inflight: set[bytes]) -> None:
        """Add the prompt blocks `req` will fill and has not cached yet: all of them when it computes
        its prompt, the stretch it holds blocks for when it is loading."""
        if self.pool.prefix_cache is None:
            return
        full = req.num_prompt_tokens // self.block_size
        if req.status == RequestStatus.LOADING:
            full = min(full, len(req.block_ids))
        if req.num_cached_blocks < full:
            inflight.update(self._hashes(req, full)[req.num_cached_blocks :])

    def _next_block_inflight(self, req: Request, num_hit: int, inflight: set[bytes]) -> bool:
        if req.output_token_ids or num_hit >= (req.num_tokens - 1) // self.block_size:
            return False
        return self._hashes(req, num_hit + 1)[num_hit] in inflight

    def _tier_hit(self, req: Request, num_hit: int) -> int:
        """How many blocks after the device hit lower tiers hold (0 without tiers)."""
        if self.tier_lookup is None or req.collects_prompt:
            return 0
        rest = self._hashes(req, (req.num_tokens - 1) // self.block_size)[num_hit:]
        return self.tier_lookup(rest) if rest else 0

    def _room(self, hit: list[int]) -> int:
        """Blocks a request admitted now may take beside its `hit` blocks (cached blocks nobody holds
        count as free until it takes them), the watermark kept back for the requests already running
        or loading to grow into (an idle engine may use it all)."""
        available = self.pool.num_free - sum(1 for b in hit if self.pool.refcount(b) == 0)
        return available - self.cfg.watermark_blocks if self.running or self.loading else available

    def _fits(self, hit: list[int], need: int) -> bool:
        """The one admission test, for every path: `need` new blocks beside the shared `hit` ones."""
        return need <= self._room(hit)

    def _take(self, req: Request, hit: list[int], need: int, status: RequestStatus) -> bool:
        """Admit `req` as running or loading with the hit blocks shared and `need` more, if they fit;
        False, with nothing changed, when they do not."""
        if not self._fits(hit, need):
            return False
        self.pool.incref(hit)
        req.block_ids = list(hit) + self.pool.allocate(need)
        req.num_cached_blocks = len(hit)
        if self.pool.prefix_cache is not None:
            self.pool.prefix_cache.record_query(req.num_tokens, len(hit) * self.block_size)
        self.waiting.remove(req)
        req.status = status
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        if status == RequestStatus.LOADING:
            self.loading[req.request_id] = req
        else:
            self.running.append(req)
        return True

    def _admit_loading(self, req: Request, hit: list[int], step: ScheduledStep) -> bool:
        if not self._take(
            req, hit, blocks_needed(req.num_tokens, self.block_size) - len(hit), RequestStatus.LOADING
        ):
            req.num_computed_tokens = 0
            return False
        step.to_load.append(req)
        return True

    def _admit_fetch(self, req: Request, hit: list[int], fetch: int, step: ScheduledStep) -> bool:
        """Admit as loading with blocks for the fetched stretch only (the rest is allocated as it is
        computed), as much of it as fits now: a long stretch must not wait for the running batch to drain.
        False, with nothing changed, when no block is free."""
        fetch = min(fetch, self._room(hit))
        if fetch <= 0 or not self._take(req, hit, fetch, RequestStatus.LOADING):
            return False
        step.to_fetch.append(req)
        return True

    def finish_fetch(self, req: Request, num_loaded: int) -> None:
        """The first `num_loaded` fetched blocks hold verified KV; the rest (a miss, a corrupt
        block, the deadline) are kept and recomputed. The request prefills on from there."""
        del self.loading[req.request_id]
        req.num_computed_tokens = (req.num_cached_blocks + num_loaded) * self.block_size
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.cache_computed_blocks(req)

    def finish_loading(self, req: Request) -> None:
        """Every prompt block is filled: the request decodes from here."""
        del self.loading[req.request_id]
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.cache_computed_blocks(req)

    def abandon_loading(self, req: Request, held: list[int]) -> None:
        """The peer failed: free the blocks (except `held`, which the caller frees later) and requeue."""
        del self.loading[req.request_id]
        self._release(req, held)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str, held: list[int] | None = None) -> None:
        """Free a request's blocks on every path: stop, length, abort. `held` blocks stay allocated
        for the caller to free once no peer can write into them."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.loading.pop(req.request_id, None)
        self._release(req, held)
        if req.swapped_tokens:
            assert self.swap is not None, "only swap_out sets swapped_tokens"
            self.swap.discard(req)
            req.swapped_tokens = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
