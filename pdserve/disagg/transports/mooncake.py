"""mooncake (optional extra): the decode worker registers its pool with a Mooncake transfer engine;
the prefill worker writes each layer's runs into it with one batched one-sided write (Mooncake's
TCP transport, P2P handshake: no etcd), nothing running on the receive path."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.disagg.transports.base import KVWriter, RemoteWriter, Run, Transport

if TYPE_CHECKING:
    from pdserve.disagg.reply_sockets import ReplySockets
    from pdserve.disagg.sink import WriterFactory
    from pdserve.protocol import PrefillJob


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


class MooncakeTransport(Transport):
    name = "mooncake"

    def open_endpoint(self, host: str, name: str, buf: np.ndarray) -> MooncakeEndpoint:
        return MooncakeEndpoint(host, buf)

    def pool_fields(self, endpoint: Any) -> dict:
        return {"mooncake_session": endpoint.session_id, "pool_base": endpoint.base}

    def writer(self, factory: WriterFactory, job: PrefillJob, sockets: ReplySockets) -> KVWriter:
        if not job.mooncake_session:
            raise ValueError(
                "transfer.backend is mooncake but the decode worker registered no pool "
                "with Mooncake (set transfer.backend: mooncake there too)"
            )
        return MooncakeWriter(
            factory.src,
            factory.block_size,
            factory.endpoint,
            job.mooncake_session,
            job.pool_base,
            job.kv_shape,
            job.elem_size,
        )
