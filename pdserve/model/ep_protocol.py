"""The step protocol between expert-parallel ranks: plain tensors over torch.distributed, no pickling.

Rank 0 runs the engine. Before every model step it broadcasts, from rank 0 to every rank:

1. a header, int64[HEADER_LEN]: op, flags, step, tokens, decode groups, prefill chunks, the lengths
   of the two step payloads below, the KV slots of the cache, the length of the KV path;
2. with FLAG_KV (the first step, or when the KV cache passed in changes), the /dev/shm path of rank
   0's KV pool as uint8 bytes: the ranks map the same pool (their replicated attention writes
   identical bytes), so KV that arrives from outside the model reaches every rank. An empty path
   means each rank keeps a private cache (a device pool, or a cache a test passes in);
3. with FLAG_PREPARE, the new placement phy2log int64[moe layers, physical slots];
4. with OP_STEP, the step's integers as one int64 tensor: input ids, positions, slot mapping, the
   block size, the (start, rows, blocks per row) of each decode group and the (q_start, q_len,
   ctx_len, blocks gathered (0: none), has_mask) of each prefill chunk, then their block indices,
   then the rows whose logits the step wants (with data-parallel attention every rank computes some);
5. with OP_STEP and masks present, every attention mask flattened into one uint8 tensor;
6. with FLAG_PRIVATE (ranks with KV pools of their own, ep_kv.py), the step's plan: the rank of each
   sequence and the blocks rank 0 sends each rank before the step.

Each length a receiver needs is in something it has already received, so every broadcast has a
known size. OP_NOOP is a heartbeat (an idle engine sends one every few seconds so that the other
ranks can tell a quiet rank 0 from a dead one), which every rank answers with a one-value
all-reduce (so rank 0 can tell a quiet rank from a lost one); OP_STOP ends the worker loop.
FLAG_DP marks a step run with data-parallel attention (dp_attention.py): each rank computes its share
of the sequences and the MoE layers exchange rows (ep_exchange.py); every rank reads rank 0's KV pool,
or with FLAG_PRIVATE its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pdserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk

HEADER_LEN = 16
OP_NOOP, OP_STEP, OP_STOP = 0, 1, 2
FLAG_PREPARE = 1  # a new placement follows; start building it in the standby buffers
FLAG_COMMIT = 2  # switch to the prepared placement before this step
FLAG_KV = 4  # the KV cache changed: its path follows
FLAG_DP = 8  # data-parallel attention this step
FLAG_PRIVATE = 16  # ... with private KV pools: the step's plan follows (ep_kv.py)


@dataclass
class Header:
    op: int = OP_NOOP
    flags: int = 0
    step: int = 0
    tokens: int = 0
    groups: int = 0
    chunks: int = 0
    ints: int = 0
    masks: int = 0
    kv_slots: int = 0
    kv_path: int = 0
    logits: int = 0  # rows whose logits the step wants, plus one (0: no logits)
    plan: int = 0  # length of the step's plan (FLAG_PRIVATE)

    def to_tensor(self) -> torch.Tensor:
        t = torch.zeros(HEADER_LEN, dtype=torch.long)
        t[:12] = torch.tensor(
            [
                self.op,
                self.flags,
                self.step,
                self.tokens,
                self.groups,
                self.chunks,
                self.ints,
                self.masks,
                self.kv_slots,
                self.kv_path,
                self.logits,
                self.plan,
            ]
        )
        return t

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        return cls(*t[:12].tolist())


class Comm:
    """Broadcast from rank 0 and sum-all-reduce over one process group. Gloo takes CPU tensors, so
    device tensors are staged through host memory when the group is gloo."""

    def __init__(self, pg, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        self.pg, self.rank, self.world = pg, rank, world
        self.host_only = pg is not None and pg.name() == "gloo"
        self.device = torch.device("cpu") if self.host_only else device
        self.timeout = timedelta(seconds=timeout_s)
        self.shm = None  # ep_shm.ShmAllToAll: the all-to-all of ranks on one host, where it builds

    def broadcast(self, t: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank 0 sends `t`; other ranks pass a buffer of the same shape and get rank 0's values back."""
        buf = t.to(self.device).contiguous()
        self.pg.broadcast(buf, 0, timeout or self.timeout).wait()
        return buf

    def all_reduce(self, t: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Sum over the ranks, within the deadline: a rank that is gone or stuck fails the step."""
        buf = t.to(self.device).contiguous()
        opts = dist.AllreduceOptions()
        opts.timeout = timeout or self.timeout
        self.pg.allreduce([buf], opts).wait()
        return buf.to(t.device)

    def all_to_all(self, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Rows of `t` to each rank (in_splits[r] rows to rank r, in order); returns the rows each rank
        sent here (out_splits[r] from rank r), within the deadline."""
        return self.start_all_to_all(t, out_splits, in_splits).wait()

    def start_all_to_all(
        self, t: torch.Tensor, out_splits: list[int], in_splits: list[int], lane: int = 0
    ) -> Pending:
        """all_to_all begun: `wait()` on the result returns the rows. On shared memory `lane` picks the
        mailboxes (one per micro-batch); gloo matches a group's collectives by their order, which
        every rank keeps."""
        if self.shm is not None and t.device.type == "cpu":
            return self.shm.start(t, out_splits, in_splits, self.timeout, lane)
        buf = t.to(self.device).contiguous()
        out = torch.empty((sum(out_splits), *t.shape[1:]), dtype=t.dtype, device=self.device)
        opts = dist.AllToAllOptions()
        opts.timeout = self.timeout
        work = self.pg.alltoall_base(out, buf, list(out_splits), list(in_splits), opts)
        return Pending(work.wait, out, t.device)


class Pending:
    """A collective in flight: `wait()` finishes it within its deadline and returns its rows."""

    def __init__(
        self, finish: Callable[[], object], out: torch.Tensor, device: torch.device | None = None
    ) -> None:
        self._finish, self._out, self._device = finish, out, device

    def wait(self) -> torch.Tensor:
        self._finish()
        return self._out if self._device is None else self._out.to(self._device)


def encode_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor | None = None,
) -> tuple[Header, torch.Tensor, torch.Tensor]:
    """The step's header (op, counts and lengths filled in), int payload and mask payload."""
    desc, data, masks = [meta.block_size], [], []
    for g in meta.decode_groups:
        desc += [g.start, *g.block_idx.shape]
        data.append(g.block_idx.reshape(-1))
        masks.append(g.mask.reshape(-1))
    for p in meta.prefills:
        desc += [
            p.q_start,
            p.q_len,
            p.ctx_len,
            0 if p.block_idx is None else p.block_idx.numel(),
            2 if p.prefix_len else p.mask is not None,
        ]  # 2: the context whole, then causal
        if p.block_idx is not None:
            data.append(p.block_idx.reshape(-1))
        if p.mask is not None:
            masks.append(p.mask.reshape(-1))
    logits = [] if logits_indices is None else [logits_indices.reshape(-1)]
    ints = torch.cat(
        [
            t.cpu().long()
            for t in (
                input_ids,
                positions,
                meta.slot_mapping,
                torch.tensor(desc, dtype=torch.long),
                *data,
                *logits,
            )
        ]
    )
    mask = torch.cat([m.cpu().to(torch.uint8) for m in masks]) if masks else torch.zeros(0, dtype=torch.uint8)
    header = Header(
        OP_STEP,
        tokens=input_ids.numel(),
        groups=len(meta.decode_groups),
        chunks=len(meta.prefills),
        ints=ints.numel(),
        masks=mask.numel(),
        logits=0 if logits_indices is None else logits_indices.numel() + 1,
    )
    return header, ints, mask


def decode_step(
    h: Header, ints: torch.Tensor, mask: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
    """The inverse of encode_step: input ids, positions, attention metadata and logits rows on `device`."""
    ints, mask = ints.to(device), mask.to(device).bool()
    t = h.tokens
    ids, positions, slots = ints[:t], ints[t : 2 * t], ints[2 * t : 3 * t]
    bs = int(ints[3 * t])
    off = 3 * t + 1
    group_desc = ints[off : off + 3 * h.groups].view(-1, 3).tolist()
    off += 3 * h.groups
    chunk_desc = ints[off : off + 5 * h.chunks].view(-1, 5).tolist()
    off += 5 * h.chunks
    moff = 0
    meta = AttentionMetadata(slot_mapping=slots, block_size=bs)
    for start, n, width in group_desc:
        idx = ints[off : off + n * width].view(n, width)
        m = mask[moff : moff + n * width * bs].view(n, 1, 1, width * bs)
        off, moff = off + n * width, moff + n * width * bs
        meta.decode_groups.append(DecodeGroup(start, idx, m))
    for q_start, q_len, ctx, nblk, has_mask in chunk_desc:
        blocks = m = None
        if nblk:
            blocks, off = ints[off : off + nblk], off + nblk
        if has_mask == 1:
            keys = nblk * bs if nblk else ctx
            m, moff = mask[moff : moff + q_len * keys].view(q_len, keys), moff + q_len * keys
        meta.prefills.append(
            PrefillChunk(q_start, q_len, ctx, blocks, m, prefix_len=ctx - q_len if has_mask == 2 else 0)
        )
    logits = ints[off : off + h.logits - 1] if h.logits else None
    return ids, positions, meta, logits
