"""Turn logits into tokens: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Each row is processed on its own, and each draw uses a generator seeded from the request's seed
and the draw's index (`Request.draw_generator`), so a request samples the same tokens whatever
else shares its batch and wherever it runs.
"""

from __future__ import annotations

import torch

from pdserve.engine.request import Request, TokenLogprob
from pdserve.model.kernels.argmax import argmax_rows


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition penalty over prompt and output (HF semantics); frequency/presence over output (OpenAI)."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
        ids, counts = torch.tensor(req.output_token_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits: [V], already divided by the temperature. Filtered entries become -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cum - sorted_logits.softmax(-1) >= top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    return logits


def _logprob_entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = float(logprobs[token])
    rank = int((logprobs > logprobs[token]).sum()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = torch.topk(logprobs, k)
        top = [(int(i), float(v)) for i, v in zip(ids, vals)]
    return TokenLogprob(token, lp, rank, top)


def logprob_entries(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """One entry per row of `logits` [n, V]: `tokens[i]`'s logprob and rank, and the `tops[i]` best."""
    lps = logits.log_softmax(-1)
    return [_logprob_entry(lps[i], t, k) for i, (t, k) in enumerate(zip(tokens, tops))]


def add_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """In place, over the last dimension of one row or of several."""
    ids = torch.tensor(list(bias), dtype=torch.long)
    logits[..., ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)


def _draw(row: torch.Tensor, req: Request, allowed: torch.Tensor | None) -> int:
    """One row off the plain greedy path: penalties, logit bias, the grammar's mask, then greedy or
    temperature, filters and the seeded draw (the mask before the filters: top-k and top-p choose
    among the tokens the grammar allows)."""
    p = req.params
    if p.has_penalties:
        row = apply_penalties(row, req)
    if p.logit_bias:
        add_logit_bias(row, p.logit_bias)
    if allowed is not None:
        if not bool(allowed.any()):
            raise ValueError("the grammar allows no token")
        row = row.masked_fill(~allowed, float("-inf"))
    if p.greedy:
        return int(row.argmax())
    row = filter_logits(row / p.temperature, p.top_k, p.top_p, p.min_p)
    # multinomial raises on NaN or inf probabilities (an overflowing temperature or penalty).
    return int(torch.multinomial(row.softmax(-1), 1, generator=req.draw_generator()))


def sample(
    logits: torch.Tensor,
    reqs: list[Request],
    allowed: dict[int, torch.Tensor] | None = None,
    failed: dict[int, str] | None = None,
) -> tuple[list[int], list[TokenLogprob | None], dict[int, str]]:
    """logits: float32 [n, V], one row per request in `reqs`; `allowed`: per constrained row, the
    tokens its grammar allows (bool [V]). The third value: the rows that could not be sampled, with
    why (`failed` given: rows already failed); their request fails alone, the others go on."""
    tokens: list[int] = [0] * len(reqs)
    allowed = allowed or {}
    failed = dict(failed or {})
    greedy_rows = [
        i
        for i, r in enumerate(reqs)
        if r.params.greedy
        and not r.params.has_penalties
        and not r.params.logit_bias
        and i not in allowed
        and i not in failed
    ]
    if greedy_rows:
        picked = argmax_rows(logits if len(greedy_rows) == len(reqs) else logits[greedy_rows])
        for i, t in zip(greedy_rows, picked):
            tokens[i] = t
    greedy_set = set(greedy_rows)
    for i, req in enumerate(reqs):
        if i in greedy_set or i in failed:
            continue
        try:
            tokens[i] = _draw(logits[i].clone(), req, allowed.get(i))
        except Exception as e:  # noqa: BLE001 - this request's values broke its draw; the batch goes on
            failed[i] = f"{type(e).__name__}: {e}"
    out_logprobs: list[TokenLogprob | None] = [None] * len(reqs)
    for i, req in enumerate(reqs):
        if req.params.logprobs is not None and i not in failed:
            # Logprobs of the model's own distribution, before penalties and filters.
            try:
                out_logprobs[i] = _logprob_entry(logits[i].log_softmax(-1), tokens[i], req.params.logprobs)
            except Exception as e:  # noqa: BLE001 - as above
                failed[i] = f"{type(e).__name__}: {e}"
    return tokens, out_logprobs, failed
