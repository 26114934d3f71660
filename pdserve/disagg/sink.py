"""Where one prefill request's KV goes (KVSink), and the writer that puts it there (WriterFactory).

The prefill worker's sender thread makes each job's writer on its first write, from the job and the
configured transfer backend: one-sided writes into a pool the decode worker registered (mooncake,
nixl), a shared-memory pool on the same host (shm), or KV frames over its control socket (tcp).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.disagg.peer import HOST
from pdserve.disagg.reply_sockets import ReplySockets
from pdserve.disagg.state import Transfer
from pdserve.disagg.transport import (
    KVWriter,
    MooncakeEndpoint,
    MooncakeWriter,
    NixlEndpoint,
    NixlWriter,
    Run,
    ShmWriter,
    TcpWriter,
)
from pdserve.protocol import PrefillJob


@dataclass
class KVSink:
    """Where one prefill request's KV goes: the decode worker's blocks.

    The engine thread owns transfer, next_block, plan, plan_end and cancelled; the sender thread owns
    writer and bytes_sent (the engine reads bytes_sent once the step's barrier has passed). Both
    threads fail a sink, through `fail`, under its lock."""

    job: PrefillJob
    transfer: Transfer
    next_block: int  # first block not yet written in full
    writer: KVWriter | None = None  # created and used on the sender thread only
    cancelled: bool = False
    bytes_sent: int = 0
    plan: list[Run] = field(default_factory=list)  # this step's runs
    plan_end: int = 0  # block index the plan reaches (exclusive, full blocks)
    chunk: Any = None  # a pipelined chunk's state (disagg/pipeline.ChunkState), engine thread
    _error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def error(self) -> str | None:
        """Why the transfer failed (the first reason given), or None."""
        with self._lock:
            return self._error

    def fail(self, reason: str) -> None:
        with self._lock:
            if self._error is None:
                self._error = reason


# What the engine and bootstrap threads hand the sender thread (its outbox), in order.
@dataclass
class SendMessage:
    endpoint: str
    wire: dict[str, Any]  # a control message's map, signed when a token is set


@dataclass
class WriteLayer:
    sink: KVSink
    layer: int
    runs: list[Run]
    computed_at: float


@dataclass
class Barrier:
    """Flush these sinks' writes, then set `done`: the step's writes are in the decode pool."""

    done: threading.Event
    sinks: list[KVSink]


@dataclass
class CloseWriter:
    sink: KVSink


@dataclass
class StopSender:
    pass


SenderOp = SendMessage | WriteLayer | Barrier | CloseWriter | StopSender


class WriterFactory:
    """Makes jobs' writers for one backend (sender thread); holds the one-sided endpoints, if any."""

    def __init__(
        self,
        src: np.ndarray,
        block_size: int,
        backend: str,
        key: bytes | None,
        transfer_s: float,
        mooncake: MooncakeEndpoint | None = None,
        nixl: NixlEndpoint | None = None,
    ) -> None:
        self.src = src
        self.block_size = block_size
        self.backend = backend
        self.key = key
        self.transfer_s = transfer_s
        self.mooncake = mooncake
        self.nixl = nixl

    def make(self, job: PrefillJob, sockets: ReplySockets) -> KVWriter:
        if self.mooncake is not None:
            if not job.mooncake_session:
                raise ValueError(
                    "transfer.backend is mooncake but the decode worker registered no pool "
                    "with Mooncake (set transfer.backend: mooncake there too)"
                )
            return MooncakeWriter(
                self.src,
                self.block_size,
                self.mooncake,
                job.mooncake_session,
                job.pool_base,
                job.kv_shape,
                job.elem_size,
            )
        if self.nixl is not None:
            if not job.nixl_metadata:
                raise ValueError(
                    "transfer.backend is nixl but the decode worker registered no pool "
                    "with NIXL (set transfer.backend: nixl there too)"
                )
            return NixlWriter(
                self.src,
                self.block_size,
                self.nixl,
                job.nixl_metadata,
                job.pool_base,
                job.kv_shape,
                job.elem_size,
                self.transfer_s,
            )
        # job.shm_path passed check_job: a pool the decode worker made, or None.
        same_host = job.decode_host == HOST and job.shm_path and os.path.exists(job.shm_path)
        if self.backend == "shm" or (self.backend == "auto" and same_host):
            if not job.shm_path:
                raise ValueError("transfer.backend is shm but the decode worker has no shared pool")
            return ShmWriter(self.src, self.block_size, job.shm_path, job.kv_shape, job.elem_size)
        # The socket stays open while the writer lives (closing it would drop the frames in flight).
        sock = sockets.pin(job.reply_endpoint)
        return TcpWriter(
            self.src,
            self.block_size,
            sock,
            self.key,
            job.transfer_id,
            flush_timeout_s=self.transfer_s,
            release=functools.partial(sockets.unpin, job.reply_endpoint),
        )

    def close(self) -> None:
        """Only once no write is in flight."""
        for ep in (self.mooncake, self.nixl):
            if ep is not None:
                ep.close()
