"""Draft tokens from a smaller model (scheduler.speculative_method: draft), verified by the target
in one batched step as n-gram drafts are (engine/spec_decode.py).

The draft model keeps its own paged KV cache and block pool, one block table per running request.
Each step it first catches up on the tokens it has not seen (the whole prompt the first time, then
the tokens the last verification emitted) in batched forwards of at most the scheduler's token
budget, whose last rows give the first draft tokens; k - 1 batched decode steps give the rest, greedily. Drafts are proposals only: the
target accepts or rejects them, so greedy output is the target's whatever the draft model says,
and sampled output keeps the target's distribution (a greedy draft is a fixed proposal, as n-gram
drafts are).

After a verification the draft model's KV holds valid entries up to the last accepted draft: its
entries after that are of rejected tokens and are computed again from the emitted ones. A request
the draft model has not seen (a new one, a migrated one, one preempted and resumed) starts by
catching up its whole sequence. A request that stops running (finished, aborted, preempted) loses
its draft state and blocks then, between steps as well as in one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.kv_cache import allocate_kv_cache
from pdserve.config import Config, ModelConfig
from pdserve.engine.request import Request
from pdserve.model.attention import build_metadata
from pdserve.model.kernels.argmax import argmax_rows
from pdserve.model.loader import build_model, load_model_files, torch_dtype

log = logging.getLogger(__name__)


@dataclass
class DraftSeq:
    blocks: list[int]
    computed: int = 0  # leading positions whose draft KV holds the request's own tokens
    pending: int | None = None  # proposed from this many tokens; the verification not yet known


class DraftModel:
    def __init__(self, config: Config, vocab_size: int, max_model_len: int, num_blocks: int) -> None:
        sc, mc = config.scheduler, config.model
        assert sc.speculative_model is not None
        dmc = ModelConfig(
            name=sc.speculative_model,
            seed=mc.seed,
            dtype=mc.dtype,
            device=mc.device,
            quantization=sc.speculative_quantization,
            attention_kernel=mc.attention_kernel,
            gemm_kernel=mc.gemm_kernel,
        )
        loaded = load_model_files(dmc.name, dmc.seed, dmc.quantization)
        if loaded.arch.vocab_size != vocab_size:
            raise ValueError(
                f"scheduler.speculative_model: {dmc.name!r} has a vocabulary of {loaded.arch.vocab_size} "
                f"tokens, the served model {vocab_size}; a draft model must share the served model's tokenizer"
            )
        self.name = dmc.name
        self.block_size = config.cache.block_size
        self.max_tokens = sc.max_num_batched_tokens  # a catch-up forward's rows at most, as a target step's
        self.model = build_model(loaded, dmc.dtype, dmc.device, max_model_len, dmc)
        del loaded
        self.device = self.model.device
        self.pool = BlockPool(num_blocks)
        self.kv_cache = allocate_kv_cache(
            self.model.arch, num_blocks, self.block_size, torch_dtype(dmc.dtype), dmc.device
        )
        self.seqs: dict[str, DraftSeq] = {}
        self.step_seconds = 0.0  # the last proposal's wall time per draft step (the policy's cost)
        log.info(
            "draft model %s: %.1f MB of weights, %d KV blocks",
            dmc.name,
            self.model.weight_bytes() / 1e6,
            num_blocks,
        )

    def drop(self, request_id: str) -> None:
        """Frees a request's draft state: it stopped running (finished, aborted, failed, migrated away
        or preempted), whenever that happened; a request that runs again catches up from its start."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(seq.blocks)

    def _reserve(self, seq: DraftSeq, positions: int) -> bool:
        need = -(-positions // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.blocks += self.pool.allocate(need)
        return True

    @torch.inference_mode()
    def propose(self, reqs: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to `depth` greedy draft tokens for each (request, depth) (none where the draft pool is
        full)."""
        t0 = time.perf_counter()
        ready: list[tuple[Request, DraftSeq, int]] = []
        for req, depth in reqs:
            seq = self.seqs.setdefault(req.request_id, DraftSeq([]))
            if seq.pending is not None:  # proposed last step but not verified: its drafts are not known
                seq.computed = min(seq.computed, seq.pending)
            seq.computed = min(seq.computed, req.num_tokens - 1)  # at least the last token runs again
            seq.pending = None
            if depth > 0 and self._reserve(seq, req.num_tokens + depth - 1):
                ready.append((req, seq, depth))
        if not ready:
            return {}
        # Catch-up: every token the draft model has not seen, in forwards of at most the scheduler's
        # token budget (a new request's whole prompt would otherwise run as one); a request's last
        # caught-up token's logits give its first draft.
        first: list[int] = [0] * len(ready)
        todo = [(i, seq.computed, req.num_tokens) for i, (req, seq, _) in enumerate(ready)]
        while todo:
            ids: list[int] = []
            positions: list[int] = []
            seqs = []
            rows: list[int] = []
            ends: list[int] = []  # the requests whose catch-up ends in this forward, by row
            left = []
            for i, start, end in todo:
                room = self.max_tokens - len(ids)
                if room <= 0:
                    left.append((i, start, end))
                    continue
                stop = min(end, start + room)
                ids += ready[i][0].all_token_ids[start:stop]
                positions += range(start, stop)
                seqs.append((ready[i][1].blocks, start, stop - start))
                if stop == end:
                    rows.append(len(ids) - 1)
                    ends.append(i)
                else:
                    left.append((i, stop, end))
            for i, t in zip(ends, self._argmax(ids, positions, seqs, rows)):
                first[i] = t
            todo = left
        drafts = [[t] for t in first]
        # Decode steps: each feeds the draft before it, for the requests that go that deep.
        steps = max(depth for _, _, depth in ready)
        for j in range(1, steps):
            live = [i for i, (_, _, depth) in enumerate(ready) if depth > j]
            pos = [ready[i][0].num_tokens + j - 1 for i in live]
            step = [(ready[i][1].blocks, p, 1) for i, p in zip(live, pos)]
            nxt = self._argmax([drafts[i][-1] for i in live], pos, step, list(range(len(live))))
            for i, t in zip(live, nxt):
                drafts[i].append(t)
        out = {}
        for (req, seq, depth), d in zip(ready, drafts):
            seq.computed = req.num_tokens + depth - 1
            seq.pending = req.num_tokens
            out[req.request_id] = d
        self.step_seconds = (time.perf_counter() - t0) / steps
        return out

    def _argmax(self, ids: list[int], positions: list[int], seqs: list, rows: list[int]) -> list[int]:
        """The greedy token after each of `rows` (none: the forward only writes KV)."""
        meta = build_metadata(seqs, self.block_size, self.model.arch.sliding_window, self.device)
        dev = self.device
        logits = self.model.forward(
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            self.kv_cache,
            torch.tensor(rows, dtype=torch.long, device=dev) if rows else None,
        )
        return argmax_rows(logits) if rows else []

    def settle(self, req: Request, accepted: int) -> None:
        """The verification of the request's last proposal accepted `accepted` drafts: the draft KV
        is valid up to the last of them."""
        seq = self.seqs.get(req.request_id)
        if seq is None or seq.pending is None:
            return
        seq.computed = min(seq.computed, seq.pending + accepted)
        seq.pending = None

    def close(self) -> None:
        for rid in list(self.seqs):
            self.drop(rid)
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
