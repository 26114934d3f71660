"""Token dispatch: map each (token, logical expert) choice to one physical replica.

`dispatch` takes an expert's replicas in turn (round robin in token order), so replica loads differ
by at most one token. `dispatch_by_load` sends each choice to the replica whose rank has the least
load assigned so far in the step, so a replica on a rank already busy with other experts' tokens
takes fewer. Both are deterministic functions of the batch and the placement: every rank that sees
the same batch picks the same slots, which keeps greedy outputs reproducible.
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


def slot_owner(num_physical: int, num_ranks: int) -> torch.Tensor:
    """Rank of each physical slot: rank r owns slots r*P//R .. (r+1)*P//R (as eplb/placement.py)."""
    ends = torch.arange(1, num_ranks + 1) * num_physical // num_ranks
    return torch.searchsorted(ends, torch.arange(num_physical), right=True)


def own_tokens(num_tokens: int, rank: int, world: int) -> tuple[int, int]:
    """The tokens `lo..hi` of a step that rank `rank` accounts for (its shared-expert share and the
    choices it counts for the balancer): an even split, so the ranks' shares add up to the batch."""
    return num_tokens * rank // world, num_tokens * (rank + 1) // world


def dispatch_by_load(
    topk_ids: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], num_ranks: int
) -> torch.Tensor:
    """Physical slot ids, same shape as `topk_ids` (logical ids of one layer), replicas chosen by load.

    `table` is `log2phy(phy2log, num_logical)`. The load of a rank is the number of choices assigned
    to its slots so far in this call. Choices of experts with one slot are assigned first (they
    have no choice); then, expert by expert in id order and token by token in batch order, each
    choice of a replicated expert goes to the replica whose rank has the least load, ties to the
    lower slot. Two replicas on one rank always tie, so only the lower one is used.
    """
    ids = torch.as_tensor(topk_ids, dtype=torch.long)
    slots, counts = table
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return ids.clone()
    per_choice = counts[flat]
    if (per_choice == 0).any():
        raise ValueError("a routed expert has no replica in phy2log")
    num_physical = int(counts.sum())
    owner = slot_owner(num_physical, num_ranks)
    out = slots[flat, 0]  # an expert's lowest slot (log2phy lists its slots in ascending order)
    load = torch.bincount(owner[out[per_choice == 1]], minlength=num_ranks)
    for e in torch.unique(flat[per_choice > 1]).tolist():
        pos = (flat == e).nonzero().squeeze(1)
        reps = slots[e, : int(counts[e])]
        ranks = owner[reps]
        first = torch.ones_like(ranks, dtype=torch.bool)
        first[1:] = ranks[1:] != ranks[:-1]  # slots ascend, so a rank's replicas are adjacent
        reps, ranks = reps[first], ranks[first]
        # Replica j's m-th choice is taken at load load[rank j] + m. Greedy picks the least
        # (load, slot) each time, and each replica's keys only grow, so the picks are the n
        # smallest keys in order: the i-th choice in batch order gets the i-th smallest.
        n = pos.numel()
        keys = (load[ranks].unsqueeze(1) + torch.arange(n)) * num_physical + reps.unsqueeze(1)
        chosen = torch.argsort(keys.reshape(-1))[:n] // n
        out[pos] = reps[chosen]
        load += torch.bincount(ranks[chosen], minlength=num_ranks)
    return out.reshape(ids.shape)
