"""All-to-all through shared memory for the expert-parallel ranks of one host.

A MoE layer with data-parallel attention exchanges rows twice (ep_exchange.py), and a decode step's
messages are small: through gloo each costs a few socket round trips and thread wake-ups, through
shared memory a copy and a flag. One file in /dev/shm (mode 0600, made by rank 0, unlinked once every
rank has mapped it) holds a mailbox per ordered pair of ranks: a header of counters and a payload area of
`capacity` bytes. The writer waits until the reader has taken its previous message (`ack`), copies
the rows in, then publishes the message count (`seq`, a release store, kernels/shm_wait.c); the
reader waits for `seq` (an acquire wait), copies the rows out and acknowledges. A message larger than
the payload area goes in rounds of chunks, every rank writing its round's chunks before reading the
round's: a rank only waits for what its peers do before they wait for it, so rounds never deadlock.

Two lanes of mailboxes, one per micro-batch of a step (ep_overlap.py): a lane's message may be in
flight while the other lane's is written, read or computed. `start` writes a message and `wait` reads
the answer, so a rank can compute between them; a message of several rounds goes whole in `start`.

Every wait has the group's deadline and watches the peer's process: a dead peer fails the step at
once, a stopped one at the deadline, as with gloo.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from datetime import timedelta
from pathlib import Path

import torch

from pdserve.model.ep_protocol import Pending
from pdserve.model.kernels import native
from pdserve.utils.shm import sweep_stale

HEADER = 64  # bytes per mailbox before its payload: seq, ack, nbytes (int64), padding to a cache line
PIDS = 4096  # bytes at the start of the file: each rank's pid (int64), then padding
CAPACITY = 4 << 20  # payload bytes per mailbox; larger messages go in chunks
LANES = 2  # mailbox sets: one per micro-batch of an overlapped step


class PeerLost(RuntimeError):
    """A rank did not answer within the deadline, or its process is gone."""


def _lib():
    lib = native.load("shm_wait")
    if lib is None:
        return None
    lib.pd_shm_wait.restype = ctypes.c_int
    lib.pd_shm_wait.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int]
    lib.pd_shm_store.restype = None
    lib.pd_shm_store.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return lib


def available() -> bool:
    """Whether the flags' helper builds here (else the ranks keep gloo's all-to-all)."""
    return _lib() is not None


def file_size(world: int, capacity: int = CAPACITY) -> int:
    return PIDS + LANES * world * world * (HEADER + capacity)


def create(world: int, capacity: int = CAPACITY, directory: str = "/dev/shm") -> str:
    """Rank 0 makes the file (sparse: pages cost memory once written) and returns its path. It is
    unlinked once every rank has mapped it; files of a rank 0 killed before that go here."""
    sweep_stale(Path(directory), "pdserve-ep")
    path = os.path.join(directory, f"pdserve-ep-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, file_size(world, capacity))
    finally:
        os.close(fd)
    return path


class ShmAllToAll:
    """One rank's view of the mailboxes in `path` (made by `create` with the same world and capacity)."""

    def __init__(self, path: str, rank: int, world: int, capacity: int = CAPACITY) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("the shared-memory flags' helper (kernels/shm_wait.c) does not build here")
        self.lib, self.rank, self.world, self.capacity = lib, rank, world, capacity
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, file_size(world, capacity))
        finally:
            os.close(fd)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._base = self._buf.data_ptr()
        self._pids = self._buf[:PIDS].view(torch.int64)
        self._pids[rank] = os.getpid()
        self._sent = [[0] * world for _ in range(LANES)]  # per lane: messages (chunks) written to each rank
        self._taken = [[0] * world for _ in range(LANES)]  # per lane: messages read from each rank

    def _box(self, src: int, dst: int, lane: int) -> int:
        return PIDS + ((lane * self.world + src) * self.world + dst) * (HEADER + self.capacity)

    def _wait(self, addr: int, want: int, peer: int, timeout_s: float) -> None:
        pid = int(self._pids[peer])
        rc = self.lib.pd_shm_wait(self._base + addr, want, timeout_s, pid)
        if rc == 1:
            raise PeerLost(f"expert-parallel rank {peer} did not answer within {timeout_s:g} s")
        if rc == 2:
            raise PeerLost(f"expert-parallel rank {peer} (pid {pid}) is gone")

    def all_to_all(
        self, t: torch.Tensor, out_splits: list[int], in_splits: list[int], timeout: timedelta
    ) -> torch.Tensor:
        """gloo's all_to_all on CPU tensors: in_splits[r] rows of `t` to rank r, out_splits[r] rows from it."""
        return self.start(t, out_splits, in_splits, timeout).wait()

    def start(
        self,
        t: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        timeout: timedelta,
        lane: int = 0,
    ) -> Pending:
        """all_to_all's first half on `lane`: this rank's rows written to its peers' mailboxes. The
        returned Pending's `wait` reads theirs. Every rank starts and waits a lane's messages in the
        same order; between the halves it may use the other lane."""
        t = t.contiguous()
        row = math.prod(t.shape[1:]) * t.element_size()
        out = torch.empty((sum(out_splits), *t.shape[1:]), dtype=t.dtype)
        src = t.view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
        dst = out.view(-1).view(torch.uint8) if out.numel() else torch.zeros(0, dtype=torch.uint8)
        send_at = [sum(in_splits[:r]) * row for r in range(self.world)]
        recv_at = [sum(out_splits[:r]) * row for r in range(self.world)]
        send_n = [in_splits[r] * row for r in range(self.world)]
        recv_n = [out_splits[r] * row for r in range(self.world)]
        # This rank's own rows never touch the mailboxes.
        me = self.rank
        if send_n[me]:
            dst[recv_at[me] : recv_at[me] + recv_n[me]].copy_(src[send_at[me] : send_at[me] + send_n[me]])
        peers = [r for r in range(self.world) if r != me]
        rounds = max(
            [self._chunks(send_n[r]) for r in peers] + [self._chunks(recv_n[r]) for r in peers] + [0]
        )
        s = timeout.total_seconds()
        for k in range(rounds):
            self._write(k, src, send_at, send_n, lane, s)
            if k < rounds - 1:  # a round's chunks are read before the next round's are written
                self._read(k, dst, recv_at, recv_n, lane, s)
        last = rounds - 1
        return Pending(lambda: self._read(last, dst, recv_at, recv_n, lane, s) if last >= 0 else None, out)

    def _chunks(self, n: int) -> int:
        return max(1, -(-n // self.capacity))  # an empty message is one empty chunk

    def _write(self, k: int, src: torch.Tensor, at: list[int], size: list[int], lane: int, s: float) -> None:
        """Round k's chunk to every peer."""
        cap = self.capacity
        for d in range(self.world):
            if d == self.rank or k >= self._chunks(size[d]):
                continue
            box = self._box(self.rank, d, lane)
            sent = self._sent[lane]
            self._wait(box + 8, sent[d], d, s)  # the reader took the previous message
            lo = k * cap
            n = min(cap, size[d] - lo)
            if n > 0:
                self._buf[box + HEADER : box + HEADER + n].copy_(src[at[d] + lo : at[d] + lo + n])
            self._buf[box + 16 : box + 24].view(torch.int64)[0] = n
            sent[d] += 1
            self.lib.pd_shm_store(self._base + box, sent[d])

    def _read(self, k: int, dst: torch.Tensor, at: list[int], size: list[int], lane: int, s: float) -> None:
        """Round k's chunk from every peer."""
        cap = self.capacity
        for r in range(self.world):
            if r == self.rank or k >= self._chunks(size[r]):
                continue
            box = self._box(r, self.rank, lane)
            taken = self._taken[lane]
            self._wait(box, taken[r] + 1, r, s)
            n = int(self._buf[box + 16 : box + 24].view(torch.int64)[0])
            lo = k * cap
            due = min(cap, size[r] - lo)
            if n != due and not (n == 0 and size[r] == 0):
                raise PeerLost(f"rank {r} sent {n} bytes where {due} were due")
            if n > 0:
                dst[at[r] + lo : at[r] + lo + n].copy_(self._buf[box + HEADER : box + HEADER + n])
            taken[r] += 1
            self.lib.pd_shm_store(self._base + box + 8, taken[r])

    def close(self) -> None:
        del self._buf, self._pids
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass
