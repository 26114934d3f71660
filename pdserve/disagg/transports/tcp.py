"""tcp: each run goes as two raw ZeroMQ frames (K, V) sent zero-copy, behind a signed header; the
decode worker receives them straight into its blocks (receiver.py). Works across hosts."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from pdserve.disagg.transports.base import KVWriter, Run, Transport
from pdserve.protocol import pack
from pdserve.protocol.pd import LayerFrames
from pdserve.utils.signing import sign

if TYPE_CHECKING:
    from pdserve.disagg.reply_sockets import ReplySockets
    from pdserve.disagg.sink import WriterFactory
    from pdserve.protocol import PrefillJob


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
            for kv in range(self.src.shape[1]):  # K and V planes, or MLA's one latent plane
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


class TcpTransport(Transport):
    name = "tcp"

    def writer(self, factory: WriterFactory, job: PrefillJob, sockets: ReplySockets) -> KVWriter:
        # The socket stays open while the writer lives (closing it would drop the frames in flight).
        sock = sockets.pin(job.reply_endpoint)
        return TcpWriter(
            factory.src,
            factory.block_size,
            sock,
            factory.key,
            job.transfer_id,
            flush_timeout_s=factory.transfer_s,
            release=functools.partial(sockets.unpin, job.reply_endpoint),
        )
