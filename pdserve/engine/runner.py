"""Model runner: turns a scheduled step into tensors, runs the model, samples."""

from __future__ import annotations

from typing import Callable

import torch

from pdserve.engine.grammar import Grammars
from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.sampler import logprob_entries, sample
from pdserve.engine.spec_decode import verify
from pdserve.model.attention import build_metadata
from pdserve.model.llama import LlamaModel
from pdserve.model.vlm import image_spans, merge_image_embeds


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, grammars: Grammars | None = None
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.grammars = grammars  # None: constrained requests are refused before they get here

    def execute(
        self,
        scheduled: list[tuple[Request, int]],
        layer_done: Callable[[int], None] | None = None,
    ) -> tuple[dict[str, list[tuple[int, TokenLogprob | None]]], dict[str, str]]:
        """Compute the scheduled tokens; returns the tokens sampled for each request whose chunk
        reaches the end of its known tokens (one, or with drafts the accepted ones and one more),
        and the requests whose sampling failed (with why)."""

        # A decode with k drafts runs as k + 1 single-token rows, one per position, each attending
        # up to its own position: decode rows the fused decode path takes (every row's key and value
        # is written before any row attends).
        units: list[tuple[Request, int, int, int]] = []  # (request, first position, tokens, draft index)
        for req, n in scheduled:
            start, k = req.num_computed_tokens, len(req.draft_tokens)
            if k and n == k + 1 and start == req.num_tokens - 1:
                units += [(req, start + i, 1, i) for i in range(k + 1)]
            else:
                units.append((req, start, n, -1))

        # Decodes first, shortest context first: the attention batches them in groups of
        # similar length (see model/attention.py). A request's verify rows by its first row's
        # position, so they stay adjacent (the sort is stable) and the native attention walks their
        # context once for all of them (decode_attention.c's chains).
        def order(u: tuple[Request, int, int, int]) -> tuple[bool, int]:
            is_decode = u[2] == 1 and u[1] > 0
            return (not is_decode, u[1] - max(u[3], 0) if is_decode else 0)

        ids: list[int] = []
        positions: list[int] = []
        seqs = []
        logits_rows: list[int] = []
        samplers: list[Request] = []
        # Decodes with drafts: request id -> its k + 1 rows, in position order.
        spec: dict[str, list[int]] = {}
        # Prompt logprobs: (request, next prompt token) per extra logits row, after the sampling rows.
        prompt_rows: list[int] = []
        prompt_next: list[tuple[Request, int]] = []
        spans: list = []  # image rows of this step (VLM prompts)
        for req, start, n, draft_i in sorted(units, key=order):
            if draft_i >= 0:
                past = start - req.num_tokens  # the last known token, then the drafts
                ids.append(req.all_token_ids[start] if past < 0 else req.draft_tokens[past])
                positions.append(start)
                seqs.append((req.block_ids, start, 1))
                rows = spec.setdefault(req.request_id, [0] * (len(req.draft_tokens) + 1))
                rows[draft_i] = len(ids) - 1
                continue
            if req.images:
                spans += image_spans(req.images, start, n, len(ids))
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seqs.append((req.block_ids, start, n))
            if req.collects_prompt:
                assert req.prompt_logprobs is not None
                # Position p's logits give prompt token p + 1's logprob; positions recomputed after a
                # preemption already gave theirs.
                first_row = len(ids) - n
                for p in range(
                    max(start, len(req.prompt_logprobs) - 1), min(start + n, req.num_prompt_tokens - 1)
                ):
                    prompt_rows.append(first_row + p - start)
                    prompt_next.append((req, req.all_token_ids[p + 1]))
            if start + n == req.num_tokens:
                logits_rows.append(len(ids) - 1)
                samplers.append(req)
        spec_reqs = {r.request_id: r for r, _, _, i in units if i >= 0}
        spec_rows = [row for rid in spec for row in spec[rid]]
        constrained = [(i, r) for i, r in enumerate(samplers) if r.params.structured is not None]
        spec_constrained = [r for r in spec_reqs.values() if r.params.structured is not None]
        masks = None
        if constrained or spec_constrained:
            assert self.grammars is not None
            masks = self.grammars.start(constrained, spec_constrained)  # computed while the forward runs
        meta = build_metadata(seqs, self.block_size, self.model.arch.sliding_window, self.device)
        dev = self.device
        ids_t = torch.tensor(ids, device=dev)
        extra = {"inputs_embeds": merge_image_embeds(self.model.embed_tokens(ids_t), spans)} if spans else {}
        logits = self.model.forward(
            ids_t,
            torch.tensor(positions, device=dev),
            meta,
            self.kv_cache,
            torch.tensor(logits_rows + spec_rows + prompt_rows, dtype=torch.long, device=dev),
            layer_done,
            **extra,
        )
        if prompt_rows:
            entries = logprob_entries(
                logits[len(logits_rows) + len(spec_rows) :].cpu(),
                [t for _, t in prompt_next],
                [r.params.prompt_logprobs or 0 for r, _ in prompt_next],
            )
            for (r, _), entry in zip(prompt_next, entries):
                assert r.prompt_logprobs is not None
                r.prompt_logprobs.append(entry)
        step = masks.result() if masks is not None else None
        drafted: dict[str, list[tuple[int, TokenLogprob | None]]] = {}
        spec_failed: dict[str, str] = {}
        if spec:
            rows = logits[len(logits_rows) : len(logits_rows) + len(spec_rows)].cpu()
            first = 0
            for rid, own in spec.items():
                req = spec_reqs[rid]
                try:
                    if step is not None and rid in step.failed:
                        raise ValueError(step.failed[rid])
                    allowed = step.drafted.get(rid) if step is not None else None
                    toks, lps = verify(rows[first : first + len(own)], req, req.draft_tokens, allowed)
                    if req.params.structured is not None:
                        assert self.grammars is not None
                        for t in toks:
                            if (why := self.grammars.accept(req, t)) is not None:
                                raise ValueError(why)
                    drafted[rid] = list(zip(toks, lps))
                except Exception as e:  # noqa: BLE001 - this request's values broke its draws; the batch goes on
                    spec_failed[rid] = f"{type(e).__name__}: {e}"
                first += len(own)
        if not samplers:
            return drafted, spec_failed
        tokens, logprobs, failed = sample(
            logits[: len(logits_rows)].cpu(),
            samplers,
            step.allowed if step else None,
            {k: v for k, v in step.failed.items() if isinstance(k, int)} if step else None,
        )
        if self.grammars is not None:
            for i, r in constrained:
                if i not in failed:
                    why = self.grammars.accept(r, tokens[i])
                    if why is not None:
                        failed[i] = why
        return (
            {
                **drafted,
                **{
                    r.request_id: [(t, lp)]
                    for i, (r, t, lp) in enumerate(zip(samplers, tokens, logprobs))
                    if i not in failed
                },
            },
            {**spec_failed, **{samplers[i].request_id: why for i, why in failed.items()}},
        )
