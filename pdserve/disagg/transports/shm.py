"""shm: the decode worker's pool is a /dev/shm file; the prefill worker maps it and copies each run
with one numpy.copyto (memcpy speed, no serialization). For workers on one host."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pdserve.disagg.transports.base import KVWriter, Run, Transport
from pdserve.utils.shm import attach_shared_kv

if TYPE_CHECKING:
    from pdserve.disagg.reply_sockets import ReplySockets
    from pdserve.disagg.sink import WriterFactory
    from pdserve.protocol import PrefillJob


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


class ShmTransport(Transport):
    name = "shm"

    def writer(self, factory: WriterFactory, job: PrefillJob, sockets: ReplySockets) -> KVWriter:
        # job.shm_path passed check_job: a pool the decode worker made, or None.
        if not job.shm_path:
            raise ValueError("transfer.backend is shm but the decode worker has no shared pool")
        return ShmWriter(factory.src, factory.block_size, job.shm_path, job.kv_shape, job.elem_size)
