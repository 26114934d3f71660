"""Token dispatch: map each (token, logical expert) choice to one physical replica.

Occurrences of one logical expert in a batch take its replicas in turn (round robin in token
order), so replica loads differ by at most one token and the result is deterministic:
the same batch always lands on the same slots, which keeps greedy outputs reproducible.
"""

from __future__ import annotations

import torch


def log2phy(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse map of one layer: (`[num_logical, max_replicas]` slots padded with -1, counts).

    Build it once per placement change, not per batch.
    """
    phy2log = torch.as_tensor(phy2log, dtype=torch.long).reshape(-1)
    order = torch.argsort(phy2log, stable=True)  # slots grouped by expert, ascending slot id
    counts = torch.bincount(phy2log, minlength=num_logical)
    if counts.numel() > num_logical:
        raise ValueError("phy2log names an expert >= num_logical")
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(phy2log.numel()) - starts[phy2log[order]]
    width = max(int(counts.max().item()), 1) if counts.numel() else 1
    table = torch.full((num_logical, width), -1, dtype=torch.long)
    table[phy2log[order], rank_in_expert] = order
    return table, counts


def dispatch(
    topk_ids: torch.Tensor,
    phy2log: torch.Tensor | None = None,
    *,
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_logical: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Physical slot ids, same shape as `topk_ids` (logical ids of one layer).

    Pass `phy2log` (one layer, `[num_physical]`) or a prebuilt `table` from `log2phy`.
    `offset` rotates which replica takes the first token, so that across steps the extra token
    of an uneven split does not always land on the same replica.
    """
    ids = torch.as_tensor(topk_ids, dtype=torch.long)
    if table is None:
        if phy2log is None:
            raise ValueError("give phy2log or table")
        n = num_logical if num_logical is not None else int(torch.as_tensor(phy2log).max()) + 1
        n = max(n, int(ids.max().item()) + 1 if ids.numel() else 0)
        table = log2phy(phy2log, n)
    slots, counts = table
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return ids.clone()
    if (counts[flat] == 0).any():
        raise ValueError("a routed expert has no replica in phy2log")
    # Occurrence index of each choice among choices of the same expert, in token order.
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    per_expert = torch.bincount(flat, minlength=counts.numel())
    first = torch.cumsum(per_expert, 0) - per_expert
    occ = torch.empty_like(flat)
    occ[order] = torch.arange(flat.numel()) - first[sorted_ids]
    pick = (occ + offset) % counts[flat]
    return slots[flat, pick].reshape(ids.shape)
