"""Which decode-pool blocks tcp KV frames may fill: the decode worker's gate between its two threads.

The engine thread opens the gate for a transfer when it sends the job (the blocks it allocated for
it) and closes it when the transfer ends; the I/O thread writes a frame only through `fill`, which
holds the same lock while checking and writing. So once `close` returns no byte of that transfer
lands any more, and the engine may free or reuse its blocks. A closed transfer's id is remembered,
so a late frame is told apart from one for a transfer this worker never started.
"""

from __future__ import annotations

import threading

import torch
import zmq

from pdserve.disagg.trust import SeenIds


class WriteGate:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # also guards the counters both threads bump
        self._live: dict[str, tuple[str, set[int]]] = {}  # rid -> (transfer id, blocks frames may fill)
        self._ended = SeenIds()  # transfer ids that ended

    # ------------------------------------------------------------------ engine thread

    def open(self, request_id: str, transfer_id: str, block_ids: list[int]) -> None:
        with self.lock:
            self._live[request_id] = (transfer_id, set(block_ids))

    def close(self, request_id: str, transfer_id: str) -> None:
        with self.lock:
            self._live.pop(request_id, None)
            self._ended.add(transfer_id)

    def ended(self, transfer_id: str) -> bool:
        with self.lock:
            return transfer_id in self._ended

    # ------------------------------------------------------------------ I/O thread

    def fill(
        self,
        sock: zmq.Socket,
        raw: torch.Tensor,
        block_size: int,
        num_layers: int,
        rid: str,
        tid: str,
        layer: int,
        runs: list[list[int]],
    ) -> tuple[int | None, bool]:
        """Receive the frames of one tcp layer header from `sock` straight into `raw`, if the live
        transfer `tid` of request `rid` owns every block in `runs`. Returns (bytes written, or None
        when refused and nothing was written; whether the transfer is unknown rather than ended).
        Frames left unread are the caller's to drain."""
        n = 0
        with self.lock:
            tid_live, blocks = self._live.get(rid, (None, set()))
            ok = (
                tid_live == tid
                and 0 <= layer < num_layers
                and all(b in blocks for d, k in runs for b in range(d, d + k))
            )
            unknown = tid_live == tid or tid not in self._ended
            for d, k in runs if ok else ():
                for kv in range(raw.shape[1]):  # K and V planes, or MLA's one latent plane
                    if not sock.getsockopt(zmq.RCVMORE):
                        raise ValueError("a KV frame is missing")
                    view = raw[layer, kv, d * block_size : (d + k) * block_size]
                    got = sock.recv_into(view.reshape(-1))
                    if got != view.nbytes:
                        raise ValueError(f"KV frame of {got} bytes, expected {view.nbytes}")
                    n += got
        return (n if ok else None), unknown


def drain(sock: zmq.Socket) -> None:
    """Skip the rest of a multipart message."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv()
