"""Cores the workers of a one-machine deployment lend each other while they are idle.

Each worker of a PD deployment gets its own threads (one each by default) so that a prompt arriving
at the prefill worker never slows the decode worker's streams: that isolation is the point of PD.
But the prefill worker is idle most of the time, and its core with it. Here every worker publishes
whether it has work, in a small file of a directory the launcher gives all of them (memory-mapped:
reading a peer's state costs no system call), and a decode step runs with its own threads plus those
of the peers that are idle at that moment. A peer that gets work takes its threads back at the
borrower's next step: one step overlaps at most. Idle threads are divided among the workers
borrowing at that moment (each computes the same division from the same files: an equal share, the
remainder to the lowest process ids), and only as many as the cores left by the busy workers' own
threads: two decode workers never both take one idle prefill worker's core.

The native kernels split a product's output columns and attention's heads and rows over threads, so
a step computes the same bits with any thread count (tests/engine/test_core_share.py): decode steps
borrow, and prefill steps where every product runs on those kernels (dense models). A prefill step
is long, so it looks again after each layer (engine.py): a peer that gets work waits a layer at most.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

from pdserve.utils.shm import pid_alive

ENV = "PDSERVE_CORE_SHARE"  # the directory, set by the launcher for the workers it starts

# One worker's file: its busy flag and its borrowing flag (one byte each, so a reader never sees half
# a write), then its threads.
_BUSY = 0
_BORROWING = 1
_THREADS = struct.Struct("<i")
_THREADS_AT = 4
_SIZE = 8
RESCAN_S = 1.0  # how often a worker looks for peers started or stopped since


class CoreShare:
    """This worker's entry in the deployment's core-sharing directory, and its view of its peers'."""

    def __init__(self, directory: str | Path, threads: int, cores: int | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.threads = threads
        # Never more threads than the cores this process may run on.
        self.cores = cores or (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
        self.pid = os.getpid()
        self.path = self.dir / str(self.pid)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._mine = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        _THREADS.pack_into(self._mine, _THREADS_AT, threads)
        self._state = (False, False)
        self._peers: dict[int, mmap.mmap] = {}
        self._scanned = float("-inf")

    def set_busy(self, busy: bool, borrowing: bool = False) -> None:
        """Whether this worker has work now, and whether its steps would take idle threads."""
        state = (busy, borrowing and busy)
        if state != self._state:
            self._mine[_BORROWING], self._mine[_BUSY] = int(state[1]), int(busy)
            self._state = state

    def lent(self) -> int:
        """The idle threads that are this worker's share now, if it is borrowing (else 0)."""
        now = time.monotonic()
        if now - self._scanned > RESCAN_S:
            self._scan()
            self._scanned = now
        me = self.pid
        states = [(me, *self._state, self.threads)] + [
            (pid, bool(m[_BUSY]), bool(m[_BORROWING]), _THREADS.unpack_from(m, _THREADS_AT)[0])
            for pid, m in self._peers.items()
        ]
        idle = sum(t for _, busy, _, t in states if not busy)
        working = sum(t for _, busy, _, t in states if busy)
        borrowers = sorted(pid for pid, busy, borrowing, _ in states if busy and borrowing)
        if me not in borrowers:
            return 0
        spare = min(idle, max(0, self.cores - working))
        share, extra = divmod(spare, len(borrowers))
        return share + (1 if borrowers.index(me) < extra else 0)

    def step_threads(self) -> int:
        """Threads for a step now (the worker marked busy and borrowing): its own and its share of the
        idle ones, within the cores."""
        return max(1, min(self.cores, self.threads + self.lent()))

    def _scan(self) -> None:
        found = set()
        for entry in os.scandir(self.dir):
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            pid = int(entry.name)
            if not pid_alive(pid):  # killed before it could remove its file: lends nothing
                continue
            found.add(pid)
            if pid not in self._peers:
                try:
                    with open(entry.path, "rb") as f:
                        self._peers[pid] = mmap.mmap(f.fileno(), _SIZE, access=mmap.ACCESS_READ)
                except (OSError, ValueError):  # removed, or not yet its full size
                    found.discard(pid)
        for pid in set(self._peers) - found:
            self._peers.pop(pid).close()

    def close(self) -> None:
        for m in self._peers.values():
            m.close()
        self._peers.clear()
        self._mine.close()
        self.path.unlink(missing_ok=True)
