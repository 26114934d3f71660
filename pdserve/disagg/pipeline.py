"""A prefill worker's part in a pipelined long prompt: one chunk of it, layer by layer behind the chunk before.

The decode worker cuts a long prompt into chunks (disagg/split.py, disagg/parallel.py) and sends
each to its own prefill worker. The worker of chunk k computes its tokens like any prefill job (its
KV goes into the decode pool layer by layer), but its attention at layer l needs the layer-l KV of
every earlier chunk: the worker of chunk k-1 tells it (a signed ChunkLayer, after that layer of its
own chunk is in the decode pool, which implies the earlier ones are), and before computing layer l
it copies those blocks from the decode pool (shared memory, mapped as the shm writer maps it) into
its own. So chunk k's layer l runs while chunk k-1 computes layer l+1.

Threads: the bootstrap thread records arrivals on the `ChunkBoard`; the engine thread waits on it
(every wait has a deadline, and a cancel ends it at once) and does the copies. A job whose first
earlier layer has not arrived yet is parked here, not added to the engine, so that waiting for a
busy peer never stalls this worker's other requests.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.disagg.peer import HOST
from pdserve.disagg.sink import KVSink
from pdserve.disagg.transports import Run, coalesce
from pdserve.engine.kv_connector import AddJob
from pdserve.protocol import PrefillJob
from pdserve.protocol.pd import ChunkLayer
from pdserve.utils.shm import attach_shared_kv

if TYPE_CHECKING:
    from pdserve.engine.request import Request

_MAX_UNCLAIMED = 1024  # arrivals remembered for jobs not (yet) here


class ChunkBoard:
    """How many leading layers of the earlier chunks are in the decode pool, per transfer id."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._layers: OrderedDict[str, int] = OrderedDict()
        self._cancelled: set[str] = set()
        self.changed = threading.Event()  # something arrived: the engine's idle wait ends

    def arrived(self, transfer_id: str, layer: int) -> None:
        with self._cond:
            self._layers[transfer_id] = max(self._layers.get(transfer_id, 0), layer + 1)
            self._layers.move_to_end(transfer_id)
            while len(self._layers) > _MAX_UNCLAIMED:
                self._layers.popitem(last=False)
            self._cond.notify_all()
        self.changed.set()

    def cancel(self, transfer_id: str) -> None:
        with self._cond:
            self._cancelled.add(transfer_id)
            self._cond.notify_all()

    def layers(self, transfer_id: str) -> int:
        with self._cond:
            return self._layers.get(transfer_id, 0)

    def wait(self, transfer_id: str, layers: int, timeout: float) -> bool:
        """True once `layers` layers are in; False at the deadline or on a cancel."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._layers.get(transfer_id, 0) < layers:
                left = deadline - time.monotonic()
                if transfer_id in self._cancelled or left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def forget(self, transfer_id: str) -> None:
        with self._cond:
            self._layers.pop(transfer_id, None)
            self._cancelled.discard(transfer_id)


@dataclass
class ChunkState:
    """One pipelined job's state on the engine thread (KVSink.chunk)."""

    job: PrefillJob
    decode_pool: np.ndarray | None = None  # the decode worker's pool, mapped at the first copy
    copies: list[Run] = field(default_factory=list)  # this step: (own block, decode block, n) to copy
    copied_upto: int = 0  # layers of `copies` done in this step
    signal: bool = False  # this step completes the chunk: tell the next worker per layer


@dataclass
class Parked:
    event: AddJob
    sink: KVSink
    since: float


class ChunkPipeline:
    def __init__(self, src: np.ndarray, block_size: int, wait_s: float, queue_s: float) -> None:
        """`src`: this worker's pool as raw bytes; `wait_s`: longest wait for one earlier layer once
        computing; `queue_s`: longest a job stays parked waiting for the first."""
        self.src = src
        self.block_size = block_size
        self.wait_s, self.queue_s = wait_s, queue_s
        self.board = ChunkBoard()
        self.parked: dict[str, Parked] = {}  # engine thread only; request id ->

    # ------------------------------------------------------------------ engine thread: jobs

    @staticmethod
    def check(job: PrefillJob, backend: str) -> None:
        """A pipelined chunk reads the decode pool (after the first) or signals that its layers are
        in it (before the last): only through shared memory on this host, where a write is in once done."""
        if not (job.upstream_tokens or job.downstream_endpoint):
            return
        if backend not in ("auto", "shm") or not (
            job.decode_host == HOST and job.shm_path and os.path.exists(job.shm_path)
        ):
            raise ValueError("a pipelined chunk needs the decode worker's pool in shared memory on this host")
        if job.upstream_tokens % job.block_size or job.upstream_tokens >= len(job.prompt_token_ids):
            raise ValueError(
                f"upstream_tokens {job.upstream_tokens} is not a block boundary inside the prompt"
            )

    def admit(self, event: AddJob, sink: KVSink, now: float) -> AddJob | None:
        """The job's AddJob now, or None: parked until the earlier chunk's first layer is in."""
        job = sink.job
        if job.upstream_tokens or job.downstream_endpoint:
            sink.chunk = ChunkState(job)
            event.kwargs["upstream_tokens"] = job.upstream_tokens
        if job.upstream_tokens and self.board.layers(job.transfer_id) == 0:
            self.parked[job.request_id] = Parked(event, sink, now)
            return None
        return event

    def released(self, now: float) -> tuple[list[AddJob], list[tuple[KVSink, str]]]:
        """Parked jobs whose first earlier layer arrived (to add), and those past their deadline (to fail)."""
        ready, expired = [], []
        self.board.changed.clear()
        for rid, p in list(self.parked.items()):
            if self.board.layers(p.sink.job.transfer_id) > 0:
                ready.append(p.event)
            elif now - p.since > self.queue_s:
                expired.append(
                    (p.sink, f"the earlier chunk's first layer did not arrive within {self.queue_s:g} s")
                )
            else:
                continue
            del self.parked[rid]
        return ready, expired

    def unpark(self, request_id: str, transfer_id: str) -> KVSink | None:
        """A cancel for a parked job: it leaves (the caller acknowledges)."""
        p = self.parked.get(request_id)
        if p is None or p.sink.job.transfer_id != transfer_id:
            return None
        del self.parked[request_id]
        self.board.forget(transfer_id)
        return p.sink

    def finished(self, sink: KVSink) -> None:
        if sink.chunk is not None:
            self.board.forget(sink.job.transfer_id)
            sink.chunk.decode_pool = None

    # ------------------------------------------------------------------ engine thread: steps

    def plan(self, scheduled: list[tuple[Request, int]]) -> None:
        """Before the forward: which earlier-chunk blocks each chunk copies this step, and whether it
        finishes its chunk (then each layer it writes is signalled downstream)."""
        bs = self.block_size
        for req, n in scheduled:
            st: ChunkState | None = req.kv_sink.chunk if req.kv_sink is not None else None
            if st is None:
                continue
            start, st.copies, st.copied_upto = req.num_computed_tokens, [], 0
            st.signal = bool(st.job.downstream_endpoint) and start + n >= req.num_tokens
            up = req.upstream_tokens // bs
            if req.upstream_tokens and start <= req.upstream_tokens and req.num_cached_blocks < up:
                # The first step of this admission: the earlier chunks' blocks not hit in this worker's cache.
                st.copies = coalesce(
                    req.block_ids[req.num_cached_blocks : up],
                    st.job.dst_block_ids[req.num_cached_blocks : up],
                )

    def before_layer(self, planned: list[Request], layer: int) -> None:
        """Wait until `layer` of the earlier chunks is in the decode pool, then copy it in."""
        for req in planned:
            sink: KVSink = req.kv_sink
            st: ChunkState | None = sink.chunk
            if st is None or not st.copies or st.copied_upto > layer or sink.error:
                continue
            if not self.board.wait(st.job.transfer_id, layer + 1, self.wait_s):
                sink.fail(f"layer {layer} of the earlier chunks did not arrive within {self.wait_s:g} s")
                continue
            try:
                self.copy_in(st, layer)
            except (OSError, ValueError) as e:  # the pool the job names is not what it claims: this job fails
                sink.fail(f"cannot read the earlier chunks' KV: {e}")
                continue
            st.copied_upto = layer + 1

    def copy_in(self, st: ChunkState, layer: int) -> None:
        """The earlier chunks' blocks of one layer, from the decode pool into this worker's."""
        if st.decode_pool is None:
            st.decode_pool = attach_shared_kv(st.job.shm_path or "", tuple(st.job.kv_shape), st.job.elem_size)
        bs, src = self.block_size, st.decode_pool
        for own, dst, k in st.copies:
            np.copyto(self.src[layer, :, own * bs : (own + k) * bs], src[layer, :, dst * bs : (dst + k) * bs])

    @staticmethod
    def signal(sink: KVSink, layer: int) -> ChunkLayer | None:
        """The message that tells the next chunk's worker `layer` is in (queued after the layer's write)."""
        st = sink.chunk
        if st is None or not st.signal:
            return None
        return ChunkLayer(st.job.request_id, st.job.downstream_transfer_id, layer)

    def wire(self, msg: dict[str, Any]) -> None:
        """A verified ChunkLayer map (bootstrap thread)."""
        m = ChunkLayer.from_wire(msg)
        if isinstance(m.layer, int) and m.layer >= 0:
            self.board.arrived(m.transfer_id, m.layer)
