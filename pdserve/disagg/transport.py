"""KV transports behind one interface: a writer moves runs of blocks of one layer into the decode pool.

- shm: the decode worker's pool is a /dev/shm file; the prefill worker maps it and copies each run
  with one numpy.copyto (memcpy speed, no serialization).
- tcp: each run goes as two raw ZeroMQ frames (K, V) sent zero-copy; the decode worker receives
  them straight into its blocks (see receiver.py).
- mooncake (optional extra): the decode worker registers its pool with a Mooncake transfer engine;
  the prefill worker writes each layer's runs into it with one batched one-sided write (Mooncake's
  TCP transport, P2P handshake: no etcd), nothing running on the receive path.
- nixl (optional extra): the same with NIXL agents over UCX; the decode worker's agent metadata
  travels in the job, and each layer's write is posted asynchronously and waited for in flush().
"""

from __future__ import annotations

import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from pdserve.protocol import pack
from pdserve.protocol.pd import LayerFrames
from pdserve.utils.shm import attach_shared_kv
from pdserve.utils.signing import sign

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


class ShmWriter(KVWriter):
    name = "shm"

    def __init__(self, src: np.ndarray, block_size: int, path: str, shape: list[int], elem_size: int) -> None:
        super().__init__(src, block_size)
        self.dst = attach_shared_kv(path, tuple(shape), elem_size)
        if self.dst.shape[:2] != src.shape[:2] or self.dst.shape[3:] != src.shape[3:]:  # slots may differ
            raise ValueError(f"decode pool {self.dst.shape} does not match this pool {src.shape}")

    def write_layer(self, request_id: str, layer: int, runs: list[Run]) -> int:
        bs, n = self.bs, 0
        for s, d, k in runs:
            src = self.src[layer, :, s * bs : (s + k) * bs]
            np.copyto(self.dst[layer, :, d * bs : (d + k) * bs], src)
            n += src.nbytes
        return n

    def close(self) -> None:
        self.dst = None  # the mapping goes with the last reference


class TcpWriter(KVWriter):
    """Frames: [header, K run 1, V run 1, K run 2, ...], sent without copying the blocks."""

    name = "tcp"

    def __init__(
        self,
        src: np.ndarray,
        block_size: int,
        sock: zmq.Socket,
        key: bytes | None = None,
        transfer_id: str = "",
        flush_timeout_s: float = 30.0,
        release: Callable[[], None] | None = None,
    ) -> None:
        """`key`: the internal token the header is signed with (the KV bytes are not: the signed
        header names the transfer and the blocks they may land in). `flush_timeout_s`: how long a
        flush waits for a peer that takes no bytes (a partition) before it fails this transfer.
        `release`: called once at close (the socket's owner may close it from then on)."""
        super().__init__(src, block_size)
        self.sock = sock
        self._release = release
        self.key, self.transfer_id = key, transfer_id
        self.flush_timeout_s = flush_timeout_s
        self._trackers: list[zmq.MessageTracker] = []

    def write_layer(self, request_id: str, layer: int, runs: list[Run]) -> int:
        bs, n = self.bs, 0
        header = LayerFrames(request_id, self.transfer_id, layer, [[d, k] for _, d, k in runs])
        frames: list[Any] = [pack(sign(header.to_wire(), self.key))]
        for s, _, k in runs:
            for kv in (0, 1):
                view = self.src[layer, kv, s * bs : (s + k) * bs]
                frames.append(memoryview(view.reshape(-1)))
                n += view.nbytes
        tracker = self.sock.send_multipart(frames, copy=False, track=True)
        self._trackers.append(tracker)
        return n

    def flush(self) -> bool:
        waited = bool(self._trackers)
        deadline = time.monotonic() + self.flush_timeout_s
        try:
            for t in self._trackers:
                try:
                    t.wait(timeout=max(0.0, deadline - time.monotonic()))
                except zmq.NotDone:
                    # The frames still reference the source blocks, which the engine will reuse: the
                    # transfer fails (its "failed" goes after them on this socket, and the decode side
                    # drops frames of a transfer that ended).
                    raise TimeoutError(
                        f"tcp KV writes not taken by the decode worker within {self.flush_timeout_s:.0f} s"
                    ) from None
        finally:
            self._trackers.clear()
        return waited

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def endpoint_host(endpoint: str) -> str:
    """The host part of "tcp://host:port"; a wildcard bind becomes this machine's name."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return socket.gethostname() if host in ("", "*", "0.0.0.0", "::") else host


class RemoteWriter(KVWriter):
    """One-sided writes into a registered remote pool (Mooncake, NIXL): checks the two pools agree
    and turns a layer's runs into (local address, remote address, bytes) segments, K and V apart."""

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
        layers, two, slots, heads, head_dim = shape
        if (layers, two) != src.shape[:2] or heads != src.shape[3] or head_dim * elem_size != src.shape[4]:
            raise ValueError(f"decode pool {shape} x {elem_size} B does not match this pool {src.shape}")
        self.local_base = local_base
        self.remote_base = remote_base
        self.remote_slots = slots
        self.src_slots = src.shape[2]
        self.row = src.shape[3] * src.shape[4]  # bytes of one slot (token) of one layer's K or V

    def segments(self, layer: int, runs: list[Run]) -> list[tuple[int, int, int]]:
        bs, row, out = self.bs, self.row, []
        for s, d, k in runs:
            if (d + k) * bs > self.remote_slots or (s + k) * bs > self.src_slots:
                raise ValueError(f"run {(s, d, k)} lies outside a pool")
            for kv in (0, 1):
                out.append(
                    (
                        self.local_base + ((layer * 2 + kv) * self.src_slots + s * bs) * row,
                        self.remote_base + ((layer * 2 + kv) * self.remote_slots + d * bs) * row,
                        k * bs * row,
                    )
                )
        return out


def _mooncake_engine_class():
    # Imported only when transfer.backend is mooncake: the base install never needs the package.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines would drown the worker's log
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(
            "transfer.backend: mooncake needs the Mooncake transfer engine: pip install 'pdserve[mooncake]' "
            "(mooncake-transfer-engine-non-cuda; on CUDA hosts mooncake-transfer-engine) and the system "
            f"library libibverbs1 (apt-get install libibverbs1). Import failed: {e}"
        ) from e
    return TransferEngine


class MooncakeEndpoint:
    """A Mooncake transfer engine in P2P-handshake mode (no etcd or metadata server) over its TCP
    transport, with one buffer registered: the decode pool that peers write into, or the prefill
    pool that writes come from."""

    def __init__(self, host: str, buf: np.ndarray) -> None:
        if not buf.flags.c_contiguous:
            raise ValueError("a Mooncake-registered pool must be one contiguous buffer")
        self.engine = _mooncake_engine_class()()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {host} (rc {rc})")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._buf = buf  # registered memory must outlive the registration
        self.base = buf.ctypes.data
        self.length = buf.nbytes
        rc = self.engine.register_memory(self.base, self.length)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {self.length} bytes (rc {rc})")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.unregister_memory(self.base)
            self.engine = None
            self._buf = None


class MooncakeWriter(RemoteWriter):
    """One batched synchronous write per layer (K and V of every run): when write_layer returns, the
    bytes are in the decode pool, so PD_DONE sent after it can never overtake them, and a cancel
    acknowledged after it means no write of this job is still in flight."""

    name = "mooncake"

    def __init__(
        self,
        src: np.ndarray,
        block_size: int,
        local: MooncakeEndpoint,
        session_id: str,
        remote_base: int,
        shape: list[int],
        elem_size: int,
    ) -> None:
        super().__init__(src, block_size, local.base, local.length, remote_base, shape, elem_size)
        self.local = local
        self.session_id = session_id

    def write_layer(self, request_id: str, layer: int, runs: list[Run]) -> int:
        segments = self.segments(layer, runs)
        local, remote, lengths = (
            [a for a, _, _ in segments],
            [b for _, b, _ in segments],
            [n for _, _, n in segments],
        )
        engine = self.local.engine
        if engine is None:
            raise RuntimeError("the Mooncake endpoint is closed")
        rc = engine.batch_transfer_sync_write(self.session_id, local, remote, lengths)
        if rc != 0:
            raise RuntimeError(f"Mooncake write of layer {layer} to {self.session_id} failed (rc {rc})")
        return sum(lengths)


def _nixl_api():
    # With libibverbs installed, UCX's efa module makes both processes segfault at exit unless it
    # is left out; UCX reads this when it loads, so it must be set before the import.
    os.environ.setdefault("UCX_MODULES", "^efa")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ImportError(
            f"transfer.backend: nixl needs NIXL: pip install 'pdserve[nixl]'. Import failed: {e}"
        ) from e
    return nixl_agent, nixl_agent_config


class NixlEndpoint:
    """A NIXL agent (UCX backend) with one buffer registered as host memory (DRAM)."""

    def __init__(self, name: str, buf: np.ndarray) -> None:
        if not buf.flags.c_contiguous:
            raise ValueError("a NIXL-registered pool must be one contiguous buffer")
        agent_cls, config_cls = _nixl_api()
        self.name = name
        self.agent = agent_cls(name, config_cls(backends=["UCX"]))
        self._buf = buf
        self.base = buf.ctypes.data
        self.length = buf.nbytes
        self._reg = self.agent.register_memory([(self.base, self.length, 0, "")], "DRAM")
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._peers: dict[bytes, str] = {}  # remote agent metadata -> its name

    def peer(self, metadata: bytes) -> str:
        """The remote agent's name, loading its metadata the first time (sender thread only)."""
        name = self._peers.get(metadata)
        if name is None:
            name = self._peers[metadata] = _text(self.agent.add_remote_agent(metadata))
        return name

    def close(self) -> None:
        if self.agent is not None:
            for name in self._peers.values():
                self.agent.remove_remote_agent(name)
            self.agent.deregister_memory(self._reg)
            self.agent = None
            self._buf = None


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


class NixlWriter(RemoteWriter):
    """One NIXL WRITE per layer (K and V of every run) posted without waiting; flush() waits for all
    of them, and so does close(), so neither PD_DONE nor a cancel's acknowledgement can precede a
    write still in flight."""

    name = "nixl"

    def __init__(
        self,
        src: np.ndarray,
        block_size: int,
        local: NixlEndpoint,
        peer_metadata: bytes,
        remote_base: int,
        shape: list[int],
        elem_size: int,
        timeout_s: float = 30.0,
    ) -> None:
        super().__init__(src, block_size, local.base, local.length, remote_base, shape, elem_size)
        self.local = local
        self.peer = local.peer(peer_metadata)
        self.timeout_s = timeout_s
        self._handles: list = []

    def write_layer(self, request_id: str, layer: int, runs: list[Run]) -> int:
        segments = self.segments(layer, runs)
        local = [(a, n, 0) for a, _, n in segments]
        remote = [(b, n, 0) for _, b, n in segments]
        agent = self.local.agent
        handle = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), self.peer
        )
        self._handles.append(handle)
        if agent.transfer(handle) == "ERR":
            raise RuntimeError(f"NIXL write of layer {layer} to {self.peer} failed")
        return sum(n for _, _, n in segments)

    def flush(self) -> bool:
        waited = bool(self._handles)
        agent = self.local.agent
        deadline = time.monotonic() + self.timeout_s
        try:
            for h in self._handles:
                while (state := agent.check_xfer_state(h)) == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"NIXL writes to {self.peer} unfinished after {self.timeout_s} s")
                    time.sleep(0.0001)  # UCX's progress thread moves the bytes meanwhile
                if state != "DONE":
                    raise RuntimeError(f"NIXL write to {self.peer} failed ({state})")
        finally:
            done = [h for h in self._handles if agent.check_xfer_state(h) != "PROC"]
            for h in done:
                agent.release_xfer_handle(h)
            self._handles = [h for h in self._handles if h not in done]
        return waited

    def close(self) -> None:
        if self._handles:
            try:
                self.flush()  # a failed or cancelled job may still have writes in flight
            except (RuntimeError, TimeoutError):
                pass  # its blocks stay quarantined on the decode side until its deadline
