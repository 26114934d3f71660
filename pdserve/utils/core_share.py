"""Cores the workers of a one-machine deployment lend each other while they are idle.

Each worker of a PD deployment gets its own threads (one each by default) so that a prompt arriving
at the prefill worker never slows the decode worker's streams: that isolation is the point of PD.
But the prefill worker is idle most of the time, and its core with it. Here every worker publishes
whether it has work, in a small file of a directory the launcher gives all of them (memory-mapped:
reading a peer's state costs no system call), and a decode step runs with its own threads plus those
of the peers that are idle at that moment. A peer that gets work takes its threads back at the
borrower's next step: one step overlaps at most.

Only decode steps borrow: the native kernels split a product's output columns over threads, so a
decode step computes the same bits with any thread count (tests/engine/test_core_share.py), while a
prefill's torch products need not.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

ENV = "PDSERVE_CORE_SHARE"  # the directory, set by the launcher for the workers it starts

# One worker's file: its busy flag (one byte, so a reader never sees half a write), then its threads.
_BUSY = 0
_THREADS = struct.Struct("<i")
_THREADS_AT = 4
_SIZE = 8
RESCAN_S = 1.0  # how often a worker looks for peers started or stopped since


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        self.path = self.dir / str(os.getpid())
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._mine = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        _THREADS.pack_into(self._mine, _THREADS_AT, threads)
        self._busy = False
        self._peers: dict[int, mmap.mmap] = {}
        self._scanned = float("-inf")

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._mine[_BUSY] = 1 if busy else 0
            self._busy = busy

    def lent(self) -> int:
        """The threads of the peers that are idle now."""
        now = time.monotonic()
        if now - self._scanned > RESCAN_S:
            self._scan()
            self._scanned = now
        return sum(_THREADS.unpack_from(m, _THREADS_AT)[0] for m in self._peers.values() if not m[_BUSY])

    def step_threads(self) -> int:
        """Threads for a decode step now: this worker's own and its idle peers', within the cores."""
        return max(1, min(self.cores, self.threads + self.lent()))

    def _scan(self) -> None:
        found = set()
        for entry in os.scandir(self.dir):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            if not _alive(pid):  # killed before it could remove its file: lends nothing
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
