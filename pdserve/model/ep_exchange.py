"""Token dispatch and combine between expert-parallel ranks (data-parallel attention).

With data-parallel attention (dp_attention.py) each rank holds only its own tokens. A MoE layer sends
a token's hidden state once to each other rank that holds one of its chosen slots, with the choices
that rank computes (slot ids and gate weights); the receiver computes the weighted sum of those
choices and sends one row back, which the token's rank adds to its own slots' sum. So a layer moves
Σ over tokens of (remote ranks among its choices) × hidden rows each way, against the replicated
design's all-reduce of every token's hidden state.

Three all-to-alls a layer, each with the deadline of every collective: the row counts, the rows with
their choices (one message in float32; the rows and the choices apart in other dtypes), the results.
The rows travel in the model's dtype (or in model.ep_dispatch_dtype: bfloat16 halves a float32
model's rows, and the receiving experts see them rounded) and the results come back in the model's
dtype; in the model's dtype the values equal EP=1's up to the order of the final sum. With two
micro-batches (ep_overlap.py) each all-to-all is started, the baton passed to the other
micro-batch, and its answer read once the baton is back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.eplb.placement import LayerPlacement, slot_range
from pdserve.model.ep_overlap import Baton

# (rows, slots [n, k] with -1 where another rank computes the choice, weights [n, k] float32) -> [n, H]
Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def slot_owners(num_physical: int, world: int) -> torch.Tensor:
    """int64 [P]: the rank holding each physical slot (slot_range's split)."""
    own = torch.empty(num_physical, dtype=torch.long)
    for r in range(world):
        lo, hi = slot_range(num_physical, r, world)
        own[lo:hi] = r
    return own


@dataclass
class Plan:
    """Where a rank's tokens go: per destination rank, the token rows sent and their choices there."""

    rows: list[torch.Tensor]  # [world] int64 token rows sent to each rank (empty for this rank)
    slots: list[torch.Tensor]  # [world] int64 [n, k]: the choices that rank computes, -1 elsewhere


def plan_dispatch(slots: torch.Tensor, owners: torch.Tensor, rank: int, world: int) -> Plan:
    """Each remote rank gets the tokens with at least one choice in its slots, once each."""
    own = owners[slots] if slots.numel() else slots
    rows, sl = [], []
    for d in range(world):
        if d == rank:
            rows.append(torch.zeros(0, dtype=torch.long))
            sl.append(torch.zeros(0, slots.shape[1], dtype=torch.long))
            continue
        hit = own == d
        r = hit.any(1).nonzero().squeeze(1)
        rows.append(r)
        sl.append(torch.where(hit[r], slots[r], -1))
    return Plan(rows, sl)


class ExpertExchange:
    """One rank's dispatch and combine over `comm` (ep_protocol.Comm); counts the bytes it sends."""

    def __init__(
        self, comm, rank: int, world: int, overlap: bool = False, dispatch_dtype: torch.dtype | None = None
    ) -> None:
        """`dispatch_dtype`: the rows' dtype on the way to other ranks (None: the model's)."""
        self.comm, self.rank, self.world = comm, rank, world
        self.dispatch_dtype = dispatch_dtype
        self._owners: dict[int, torch.Tensor] = {}
        self.dispatch_bytes = 0  # hidden rows sent to other ranks
        self.combine_bytes = 0  # result rows sent back
        self.dispatch_rows = 0
        # Ranks with KV pools of their own (ep_kv.py): blocks rank 0 sent, KV rows rank 0 received.
        self.kv_shipped_bytes = 0
        self.kv_mirrored_bytes = 0
        # the rows rank 0 computes the step's logits from (rank 0: received; others: sent)
        self.logits_bytes = 0
        self.baton = Baton() if overlap else None  # two micro-batches a step (model.ep_overlap)

    def _all_to_all(self, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        lane = self.baton.lane() if self.baton is not None else None
        if lane is None:
            return self.comm.all_to_all(t, out_splits, in_splits)
        pending = self.comm.start_all_to_all(t, out_splits, in_splits, lane)
        self.baton.pass_()  # the other micro-batch computes while this message is in flight
        return pending.wait()

    def owners(self, num_physical: int) -> torch.Tensor:
        if num_physical not in self._owners:
            self._owners[num_physical] = slot_owners(num_physical, self.world)
        return self._owners[num_physical]

    def __call__(
        self,
        h: torch.Tensor,
        slots: torch.Tensor,
        weights: torch.Tensor,
        pl: LayerPlacement,
        compute: Compute,
    ) -> torch.Tensor:
        """h [t, H] this rank's tokens; slots/weights [t, k] their choices -> [t, H]: the weighted sum
        over every choice, wherever its slot lives. Every rank calls it once per MoE layer, in order,
        with or without tokens."""
        plan = plan_dispatch(slots.cpu(), self.owners(pl.phy2log.numel()), self.rank, self.world)
        sizes = [int(r.numel()) for r in plan.rows]
        counts = self._all_to_all(torch.tensor(sizes, dtype=torch.long), [1] * self.world, [1] * self.world)
        recv = counts.tolist()
        w32 = weights.float()
        send_rows = torch.cat(plan.rows)
        k = slots.shape[1]
        x_send = h.index_select(0, send_rows.to(h.device)).to(self.dispatch_dtype or h.dtype)
        slots_send = torch.cat(plan.slots).reshape(-1, k)
        w_send = torch.cat([w32.cpu()[r] for r in plan.rows]) if send_rows.numel() else w32.new_zeros(0, k)
        H = h.shape[1]
        if x_send.dtype == torch.float32:
            # One message: the rows with their choices (slot ids are exact in float32 below 2**24).
            got = self._all_to_all(
                torch.cat([x_send.cpu(), slots_send.float(), w_send.reshape(-1, k)], dim=1), recv, sizes
            )
            x_recv, s_recv, w_recv = got[:, :H], got[:, H : H + k].long(), got[:, H + k :]
        else:
            # The rows in their dtype; a choice as its slot and its gate weight's bits, one int64 tensor.
            x_recv = self._all_to_all(x_send, recv, sizes)
            meta = torch.cat([slots_send, w_send.reshape(-1, k).view(torch.int32).long()], dim=1)
            meta = self._all_to_all(meta, recv, sizes)
            s_recv, w_recv = meta[:, :k], meta[:, k:].int().view(torch.float32)
        self.dispatch_bytes += x_send.numel() * x_send.element_size()
        self.dispatch_rows += int(send_rows.numel())
        # This rank's slots over its own tokens and the rows it received in one call, so each of its
        # experts is read once a step (the other ranks' slots are outside [lo, hi) and skipped).
        t = h.shape[0]
        if t + x_recv.shape[0]:
            both = compute(
                torch.cat([h, x_recv.to(h.device, h.dtype)]),
                torch.cat([slots, s_recv.to(slots.device)]).contiguous(),
                torch.cat([w32, w_recv.to(w32.device)]).contiguous(),
            )
        else:
            both = torch.zeros_like(h)
        out, y = both[:t], both[t:]
        back = self._all_to_all(y.to(h.dtype), sizes, recv)
        self.combine_bytes += y.numel() * h.element_size()
        if send_rows.numel():
            out.index_add_(0, send_rows.to(h.device), back.to(h.device))
        return out
