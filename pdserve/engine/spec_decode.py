"""Speculative decoding with n-gram (prompt lookup) drafts, verified in the same batched step.

Proposal: the last n tokens of a request (n from prompt_lookup_max down to prompt_lookup_min) are
looked up earlier in its own prompt and output; the tokens that followed the latest earlier match
are the draft. Text that quotes, rewrites or edits its input repeats such runs; free text rarely
does, and then no draft is proposed and the step is a plain decode.

An edit (a typo fixed, a name changed) ends such a run, and the text after it continues the source
while its last n tokens, which span the edit, are found nowhere: a lookup by n tokens resumes only
n tokens later. So where none is found, the last token alone is realigned: an earlier occurrence of
it counts where a pair of tokens just before the edit (at most EDIT_GAP tokens back on either side)
also precedes it in the same order, the earlier text's run interrupted by the same edit. Without
such an anchor a lone token (a comma, a "the") is not looked up: its continuations are guesses.

Verification: the request's last token and its k draft tokens run through the model as one chunk
(k + 1 logits rows). Greedy: drafts are accepted while each equals the argmax at its position; the
argmax after the last accepted one is the bonus token. So the output is token-identical to plain
greedy decoding. Sampled: a draft is a fixed proposal (probability 1 for its token), so the
rejection-sampling rule accepts draft token x with probability p(x) under the processed target
distribution p at its position, and after a rejection draws from p with x removed: every emitted
token is distributed exactly as the target's. Each position's draws use the generator of its output
index (`Request.draw_generator`), as non-speculative sampling does.

A constrained request (structured outputs) drafts only the prefix its grammar allows, and each
position is verified under its own mask (the grammar advanced over the drafts before it). Requests
with penalties, which depend on every token before a position, draft nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.request import Request, TokenLogprob, draw_seed
from pdserve.engine.sampler import _logprob_entry, add_logit_bias, filter_logits
from pdserve.model.kernels.argmax import argmax_rows

EDIT_GAP = 3  # the most tokens an edit replaces, or puts in their place, for realign() to bridge it
REALIGN_CANDIDATES = 64  # the latest earlier occurrences of the last token that realign() weighs


def propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens, or
    where there is none, of its last token realigned past an edit (realign)."""
    if k <= 0 or len(tokens) <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    last = len(arr)
    for n in range(min(n_max, last - 1), n_min - 1, -1):
        tail = arr[last - n :]
        # Windows of n tokens that end before the tail starts and have a continuation.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: last - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        hits = hits[hits + n < last]
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start : min(start + k, last)]]
    start = realign(tokens, arr)
    return [] if start < 0 else [int(t) for t in tokens[start : min(start + k, last)]]


def realign(tokens: list[int], arr: np.ndarray, gap: int = EDIT_GAP) -> int:
    """Where the text after the latest earlier occurrence h of the last token starts (h + 1), for the
    latest h with an anchor: the pair of tokens that ends e + 1 tokens before the last one (1 <= e <=
    gap: the edit's own tokens between) also ends s + 1 tokens before h (0 <= s <= gap: the tokens
    it replaced). -1 where no occurrence has one. `arr`: the same tokens as an int64 array. The
    occurrences are found with numpy, the anchors checked on plain ints (a few dozen lookups, where
    numpy's per-call cost would dominate)."""
    last = len(tokens) - 1  # the last token's index
    if last < gap + 3:
        return -1
    anchors: dict[tuple[int, int], int] = {}  # the output's anchor pairs -> where the latest starts
    for e in range(gap, 0, -1):
        a = last - e - 2
        anchors[(tokens[a], tokens[a + 1])] = a
    hits = np.flatnonzero(arr[2 : last - 1] == tokens[last])[-REALIGN_CANDIDATES:] + 2
    for h in hits[::-1].tolist():
        for s in range(gap + 1):
            b = h - s - 2
            if b >= 0 and b + 1 < anchors.get((tokens[b], tokens[b + 1]), -1):
                return h + 1
    return -1


def eligible(req: Request) -> bool:
    """Penalties depend on every token before a position: its row alone cannot apply them."""
    return not req.params.has_penalties


def _probs(row: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    return filter_logits(row / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)


def _processed(rows: torch.Tensor, req: Request, allowed: torch.Tensor | None) -> torch.Tensor:
    """The rows as the sampler would see them: logit_bias added, the grammar's masks applied."""
    p = req.params
    if not p.logit_bias and allowed is None:
        return rows
    rows = rows.clone()
    if p.logit_bias:
        add_logit_bias(rows, p.logit_bias)
    if allowed is not None:
        rows = rows.masked_fill(~allowed, float("-inf"))
    return rows


def verify(
    rows: torch.Tensor, req: Request, draft: list[int], allowed: torch.Tensor | None = None
) -> tuple[list[int], list[TokenLogprob | None]]:
    """rows: float32 [k + 1, V], the logits after the request's last token and after each draft token;
    `allowed`: a constrained request's masks at those positions (bool [k + 1, V]). The tokens to emit
    (the accepted drafts, then one more) and their logprobs (of the model's own rows) when asked."""
    p = req.params
    out: list[int] = []
    base = len(req.output_token_ids)
    raw, rows = rows, _processed(rows, req, allowed)
    if p.greedy:
        best = argmax_rows(rows)
        for i, d in enumerate(draft):
            out.append(best[i])
            if best[i] != d:
                break
        else:
            out.append(best[len(draft)])
    else:
        for i in range(len(draft) + 1):
            gen = torch.Generator().manual_seed(draw_seed(req.sample_seed or 0, base + i))
            probs = _probs(rows[i], req)
            if i == len(draft):
                out.append(int(torch.multinomial(probs, 1, generator=gen)))
                break
            d = draft[i]
            if float(torch.rand(1, generator=gen)) < float(probs[d]):
                out.append(d)
                continue
            rest = probs.clone()
            rest[d] = 0.0
            out.append(int(torch.multinomial(rest, 1, generator=gen)))
            break
    lps: list[TokenLogprob | None] = [None] * len(out)
    if p.logprobs is not None:
        lps = [_logprob_entry(raw[i].log_softmax(-1), t, p.logprobs) for i, t in enumerate(out)]
    return out, lps
