"""What every KV transport shares: runs of blocks, the writer interface, the one-sided writers'
address arithmetic, the bandwidth cap, and the Transport a backend name stands for (registry in
__init__.py)."""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pdserve.disagg.reply_sockets import ReplySockets
    from pdserve.disagg.sink import WriterFactory
    from pdserve.protocol import PrefillJob

Run = tuple[int, int, int]  # (first source block, first destination block, number of blocks)


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

    def __init__(self, bytes_per_s: float | None, clock=time.monotonic, sleep=time.sleep) -> None:
        self.rate = bytes_per_s
        self.clock, self.sleep = clock, sleep
        self._start = clock()
        self._sent = 0

    def consume(self, nbytes: int) -> None:
        if not self.rate:
            return
        self._sent += nbytes
        ahead = self._sent / self.rate - (self.clock() - self._start)
        if ahead > 0:
            self.sleep(ahead)
        elif ahead < -1.0:  # idle for a while: don't let a burst through afterwards
            self._start, self._sent = self.clock(), 0


def parse_bandwidth_limit(value: str | float | None, measured_bytes_per_s: float) -> float | None:
    if value in (None, "", 0):
        return None
    if isinstance(value, str) and value.strip().endswith("%"):
        return measured_bytes_per_s * float(value.strip()[:-1]) / 100.0
    return float(value)


def measure_memcpy_bytes_per_s(nbytes: int = 64 << 20) -> float:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)  # fault the pages in first
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


def endpoint_host(endpoint: str) -> str:
    """The host part of "tcp://host:port"; a wildcard bind becomes this machine's name."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return socket.gethostname() if host in ("", "*", "0.0.0.0", "::") else host


class RemoteWriter(KVWriter):
    """One-sided writes into a registered remote pool (Mooncake, NIXL): checks the two pools agree
    and turns a layer's runs into (local address, remote address, bytes) segments, K and V apart
    (one plane with MLA's latent KV)."""

    def __init__(
        self,
        src: np.ndarray,
        block_size: int,
        local_base: int,
        local_length: int,
        remote_base: int,
        shape: list[int],
        elem_size: int,
    ) -> None:
        super().__init__(src, block_size)
        if local_base != src.ctypes.data or local_length != src.nbytes:
            raise ValueError(f"the local {self.name} endpoint must have this pool registered")
        layers, planes, slots, heads, head_dim = shape
        if (layers, planes) != src.shape[:2] or heads != src.shape[3] or head_dim * elem_size != src.shape[4]:
            raise ValueError(f"decode pool {shape} x {elem_size} B does not match this pool {src.shape}")
        self.local_base = local_base
        self.remote_base = remote_base
        self.remote_slots = slots
        self.src_slots = src.shape[2]
        self.planes = planes
        self.row = src.shape[3] * src.shape[4]  # bytes of one slot (token) of one layer's K or V

    def segments(self, layer: int, runs: list[Run]) -> list[tuple[int, int, int]]:
        bs, row, out = self.bs, self.row, []
        for s, d, k in runs:
            if (d + k) * bs > self.remote_slots or (s + k) * bs > self.src_slots:
                raise ValueError(f"run {(s, d, k)} lies outside a pool")
            for kv in range(self.planes):
                plane = layer * self.planes + kv
                out.append(
                    (
                        self.local_base + (plane * self.src_slots + s * bs) * row,
                        self.remote_base + (plane * self.remote_slots + d * bs) * row,
                        k * bs * row,
                    )
                )
        return out


class Transport(ABC):
    """One backend of transfer.backend. One-sided transports (Mooncake, NIXL) register a pool with an
    endpoint on both workers; the decode worker's job carries what the prefill worker needs to reach it."""

    name: str

    def open_endpoint(self, host: str, name: str, buf: np.ndarray) -> Any:
        """The endpoint with `buf` registered, for one-sided writes into or out of it (None: not one-sided)."""
        return None

    def pool_fields(self, endpoint: Any) -> dict:
        """The PrefillJob fields that let a prefill worker write into this decode worker's pool."""
        return {}

    @abstractmethod
    def writer(self, factory: WriterFactory, job: PrefillJob, sockets: ReplySockets) -> KVWriter:
        """A writer of `job`'s KV from the prefill pool of `factory` into the decode worker's pool."""
