"""Token masks of constrained requests (structured outputs, forced tool calls), with llguidance.

Each constrained request owns a matcher, built the first time it samples here from the tokens it
has generated so far. So the state is rebuilt wherever a request goes on: a decode worker after the
prefill worker drew the first token, a stream migrated mid-way, a prefill job resuming a stream.

The masks of one step are computed on a thread while the model's forward runs (llguidance drops the
GIL; the forward does not need them, only the sampler does), for all the step's constrained requests
in one call whatever their grammars.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.common.structured import Constraint, grammar

if TYPE_CHECKING:
    import llguidance as ll

    from pdserve.common.tokenizer import TokenizerWrapper
    from pdserve.engine.request import Request

# Compiled grammars kept for reuse (requests of one schema copy the pristine matcher).
MAX_CACHED = 128


@dataclass
class GrammarState:
    matcher: ll.LLMatcher
    consumed: int = 0  # output tokens fed to the matcher
    error: str | None = None

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more: the request is done."""
        return self.matcher.is_stopped()


@dataclass
class StepMasks:
    """Allowed tokens per constrained row (and per position of a drafted request) of one step;
    `failed`: rows and requests whose grammar broke, with why."""

    allowed: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> bool [vocab]
    drafted: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> bool [k + 1, vocab]
    failed: dict[int | str, str] = field(default_factory=dict)  # rows, and request ids of drafted ones


class Grammars:
    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltok: ll.LLTokenizer | None = None
        self._executor: ll.LLExecutor | None = None
        self._pristine: dict[Constraint, ll.LLMatcher] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _tok(self) -> ll.LLTokenizer:
        # Built on first use (~0.5 s for a 49k vocabulary): engines that never see a constraint skip it.
        if self._lltok is None:
            import llguidance as ll

            self._lltok = ll.LLTokenizer(
                self._tokenizer.tok.to_str(), n_vocab=self.vocab_size, eos_token=self._eos
            )
            self._executor = ll.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 1) // 2)))
        return self._lltok

    def _new_matcher(self, c: Constraint) -> ll.LLMatcher:
        import llguidance as ll

        base = self._pristine.get(c)
        if base is None:
            base = ll.LLMatcher(self._tok(), grammar(c), log_level=0)
            if len(self._pristine) >= MAX_CACHED:
                self._pristine.pop(next(iter(self._pristine)))
            self._pristine[c] = base
        return base.deep_copy()

    def state(self, req: Request) -> GrammarState:
        """The request's matcher, caught up with every token it has generated."""
        st: GrammarState | None = req.grammar
        if st is None:
            assert req.params.structured is not None
            st = GrammarState(self._new_matcher(Constraint.from_wire(req.params.structured)))
            req.grammar = st
        if st.error is None and st.consumed < len(req.output_token_ids):
            new = req.output_token_ids[st.consumed :]
            if not st.matcher.consume_tokens(new):
                st.error = f"the output left its grammar: {st.matcher.get_error()[:300]}"
            st.consumed = len(req.output_token_ids)
        if st.error is None and st.matcher.is_error():
            st.error = st.matcher.get_error()[:300]
        return st

    def _compute(self, reqs: list[tuple[int, Request]], spec: list[Request]) -> StepMasks:
        out = StepMasks()
        # (key, state, drafts): a sampling row's mask, or a drafted request's k + 1 masks (the one
        # after its last token, then after each draft token; the matcher is rolled back after).
        ready: list[tuple[int | str, GrammarState, list[int]]] = []
        keyed: list[tuple[int | str, Request]] = [*reqs, *((r.request_id, r) for r in spec)]
        for key, req in keyed:
            try:
                st = self.state(req)
            except Exception as e:  # noqa: BLE001 - this request's grammar failed; the batch goes on
                out.failed[key] = f"{type(e).__name__}: {e}"
                continue
            if st.error is not None:
                out.failed[key] = st.error
            else:
                ready.append((key, st, req.draft_tokens if isinstance(key, str) else []))
        if not ready:
            return out
        words = (self.vocab_size + 31) // 32
        firsts = np.cumsum([0] + [len(d) + 1 for _, _, d in ready]).tolist()
        bits = np.zeros((firsts[-1], words), dtype=np.int32)
        assert self._executor is not None
        plain = [(st.matcher, firsts[i]) for i, (_, st, d) in enumerate(ready) if not d]
        drafts = [(st.matcher, firsts[i], d) for i, (_, st, d) in enumerate(ready) if d]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bits.ctypes.data, words * 4, firsts[-1])
        if drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafts, bits.ctypes.data, words * 4, firsts[-1]
            )
        flags = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        allowed = torch.from_numpy(flags.astype(np.bool_))
        for i, (key, st, d) in enumerate(ready):
            if st.matcher.is_error():
                out.failed[key] = st.matcher.get_error()[:300]
            elif isinstance(key, str):
                out.drafted[key] = allowed[firsts[i] : firsts[i] + len(d) + 1]
            else:
                out.allowed[key] = allowed[firsts[i]]
        return out

    def valid_drafts(self, req: Request) -> list[int]:
        """The longest prefix of the request's drafts its grammar allows (none if it is broken)."""
        st = self.state(req)
        if st.error is not None:
            return []
        return req.draft_tokens[: st.matcher.validate_tokens(req.draft_tokens)]

    def start(self, reqs: list[tuple[int, Request]], spec: list[Request] | None = None) -> Future[StepMasks]:
        """Computes the masks of (sampling row, request) pairs, and of requests with drafts, on a
        thread; the caller runs the forward meanwhile and takes the result before sampling."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self._compute, reqs, spec or [])

    def accept(self, req: Request, token: int) -> str | None:
        """Feeds a sampled token; returns why it broke the grammar (None: it did not)."""
        st = req.grammar
        if st is None or st.error is not None:
            return st.error if st else None
        if not st.matcher.consume_token(token):
            st.error = f"token {token} left the grammar: {st.matcher.get_error()[:300]}"
        st.consumed += 1
        return st.error
