"""Where one prefill request's KV goes (KVSink), and the writer that puts it there (WriterFactory).

The prefill worker's sender thread makes each job's writer on its first write, from the job and the
configured transfer backend: one-sided writes into a pool the decode worker registered (mooncake,
nixl), a shared-memory pool on the same host (shm), or KV frames over its control socket (tcp).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.disagg.peer import HOST
from pdserve.disagg.reply_sockets import ReplySockets
from pdserve.disagg.state import Transfer
from pdserve.disagg.transports import KVWriter, Run, transport
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
    """Makes jobs' writers for one backend (sender thread); holds the one-sided endpoint, if any."""

    def __init__(
        self,
        src: np.ndarray,
        block_size: int,
        backend: str,
        key: bytes | None,
        transfer_s: float,
        endpoint: Any = None,
    ) -> None:
        """`endpoint`: the one-sided transport's endpoint with `src` registered (transports.open_endpoint)."""
        self.src = src
        self.block_size = block_size
        self.backend = backend
        self.key = key
        self.transfer_s = transfer_s
        self.endpoint = endpoint

    def make(self, job: PrefillJob, sockets: ReplySockets) -> KVWriter:
        name = self.backend
        if name == "auto":  # shm to a decode worker on this host with a shared pool, tcp otherwise
            same_host = job.decode_host == HOST and job.shm_path and os.path.exists(job.shm_path)
            name = "shm" if same_host else "tcp"
        return transport(name).writer(self, job, sockets)

    def close(self) -> None:
        """Only once no write is in flight."""
        if self.endpoint is not None:
            self.endpoint.close()
