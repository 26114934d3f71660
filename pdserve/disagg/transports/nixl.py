"""nixl (optional extra): one-sided writes as with Mooncake, through NIXL agents over UCX; the decode
worker's agent metadata travels in the job, and each layer's write is posted asynchronously and
waited for in flush()."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.disagg.transports.base import KVWriter, RemoteWriter, Run, Transport

if TYPE_CHECKING:
    from pdserve.disagg.reply_sockets import ReplySockets
    from pdserve.disagg.sink import WriterFactory
    from pdserve.protocol import PrefillJob


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


class NixlTransport(Transport):
    name = "nixl"

    def open_endpoint(self, host: str, name: str, buf: np.ndarray) -> NixlEndpoint:
        return NixlEndpoint(name, buf)

    def pool_fields(self, endpoint: Any) -> dict:
        return {"nixl_metadata": endpoint.metadata, "pool_base": endpoint.base}

    def writer(self, factory: WriterFactory, job: PrefillJob, sockets: ReplySockets) -> KVWriter:
        if not job.nixl_metadata:
            raise ValueError(
                "transfer.backend is nixl but the decode worker registered no pool "
                "with NIXL (set transfer.backend: nixl there too)"
            )
        return NixlWriter(
            factory.src,
            factory.block_size,
            factory.endpoint,
            job.nixl_metadata,
            job.pool_base,
            job.kv_shape,
            job.elem_size,
            factory.transfer_s,
        )
