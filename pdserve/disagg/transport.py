"""KV transports behind one interface: a writer moves runs of blocks of one layer into the decode pool.

- shm: the decode worker's pool is a /dev/shm file; the prefill worker maps it and copies each run
  with one numpy.copyto (memcpy speed, no serialization).
- tcp: each run goes as two raw ZeroMQ frames (K, V) sent zero-copy; the decode worker receives
  them straight into its blocks (see receiver.py).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np
import zmq

from pdserve.cache.kv_cache import attach_shared_kv
from pdserve.protocol import PD_LAYER, pack

Run = tuple[int, int, int]      # (first source block, first destination block, number of blocks)


def coalesce(src_blocks: list[int], dst_blocks: list[int]) -> list[Run]:
    """Pair blocks into runs contiguous on both sides, so each run is one copy (or two frames)."""
    runs: list[Run] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class Throttle:
    """Caps the average rate at `bytes_per_s` by sleeping after each write (None: no cap)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._start = time.monotonic()
        self._sent = 0

    def consume(self, nbytes: int) -> None:
        if not self.rate:
            return
        self._sent += nbytes
        ahead = self._sent / self.rate - (time.monotonic() - self._start)
        if ahead > 0:
            time.sleep(ahead)
        elif ahead < -1.0:          # idle for a while: don't let a burst through afterwards
            self._start, self._sent = time.monotonic(), 0


def parse_bandwidth_limit(value: str | float | None, measured_bytes_per_s: float) -> float | None:
    if value in (None, "", 0):
        return None
    if isinstance(value, str) and value.strip().endswith("%"):
        return measured_bytes_per_s * float(value.strip()[:-1]) / 100.0
    return float(value)


def measure_memcpy_bytes_per_s(nbytes: int = 64 << 20) -> float:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)                 # fault the pages in first
    t = time.perf_counter()
    np.copyto(b, a)
    return nbytes / (time.perf_counter() - t)


class KVWriter(ABC):
    """Writes runs of one layer from the prefill pool `src` (raw bytes view) into a decode pool."""

    name: str

    def __init__(self, src: np.ndarray, block_size: int) -> None:
        self.src = src
        self.bs = block_size

    @abstractmethod
    def write_layer(self, request_id: str, layer: int, runs: list[Run]) -> int:
        """Returns the bytes written (or handed to the network)."""

    def flush(self) -> bool:
        """Returns once the source memory of every write so far may be reused; True if it had to wait
        (writes that complete asynchronously)."""
        return False

    def close(self) -> None:
        pass


class ShmWriter(KVWriter):
    name = "shm"

    def __init__(self, src: np.ndarray, block_size: int, path: str, shape: list[int], elem_size: int) -> None:
        super().__init__(src, block_size)
        self.dst = attach_shared_kv(path, tuple(shape), elem_size)
        if self.dst.shape[:2] != src.shape[:2] or self.dst.shape[3:] != src.shape[3:]:   # slots may differ
            raise ValueError(f"decode pool {self.dst.shape} does not match this pool {src.shape}")

    def write_layer(self, request_id: str, layer: int, runs: list[Run]) -> int:
        bs, n = self.bs, 0
        for s, d, k in runs:
            src = self.src[layer, :, s * bs:(s + k) * bs]
            np.copyto(self.dst[layer, :, d * bs:(d + k) * bs], src)
            n += src.nbytes
        return n

    def close(self) -> None:
        self.dst = None             # the mapping goes with the last reference


class TcpWriter(KVWriter):
    """Frames: [header, K run 1, V run 1, K run 2, ...], sent without copying the blocks."""

    name = "tcp"

    def __init__(self, src: np.ndarray, block_size: int, sock: zmq.Socket) -> None:
        super().__init__(src, block_size)
        self.sock = sock
        self._trackers: list[zmq.MessageTracker] = []

    def write_layer(self, request_id: str, layer: int, runs: list[Run]) -> int:
        bs, n = self.bs, 0
        frames = [pack({"type": PD_LAYER, "request_id": request_id, "layer": layer,
                        "runs": [[d, k] for _, d, k in runs], "data": True})]
        for s, _, k in runs:
            for kv in (0, 1):
                view = self.src[layer, kv, s * bs:(s + k) * bs]
                frames.append(memoryview(view.reshape(-1)))
                n += view.nbytes
        tracker = self.sock.send_multipart(frames, copy=False, track=True)
        self._trackers.append(tracker)
        return n

    def flush(self) -> bool:
        waited = bool(self._trackers)
        for t in self._trackers:
            t.wait(timeout=30)
        self._trackers.clear()
        return waited
