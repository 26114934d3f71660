"""The prefill worker's side: accept jobs, compute them, write each layer into the decode pool as it lands.

Three threads, each owning its sockets: the bootstrap thread receives jobs and cancels; the engine
thread computes (and calls the hooks here); the sender thread does every write and every outbound
message in one FIFO order, so `done` can never overtake a layer. The engine waits at the end of
each step until that step's writes are out (`end_step`): the overlap is within a step, layer i's
copy running while layer i+1 computes, and a block is never reused while still being read.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from pdserve.cache.kv_cache import raw_bytes_view
from pdserve.common import tracing
from pdserve.common.images import ImageInput
from pdserve.common.sampling import SamplingParams
from pdserve.config import Config, served_names
from pdserve.disagg.binding import bind_again
from pdserve.disagg.peer import HOST, LivenessClock, process_gone
from pdserve.disagg.pipeline import ChunkPipeline
from pdserve.disagg.reply_sockets import ReplySockets
from pdserve.disagg.sender_loop import sender_loop
from pdserve.disagg.sink import (
    Barrier,
    CloseWriter,
    KVSink,
    SenderOp,
    SendMessage,
    StopSender,
    WriteLayer,
    WriterFactory,
)
from pdserve.disagg.state import Deadlines, Transfer, TransferState
from pdserve.disagg.transports import (
    Throttle,
    coalesce,
    endpoint_host,
    measure_memcpy_bytes_per_s,
    open_endpoint,
    parse_bandwidth_limit,
)
from pdserve.disagg.trust import (
    BAD_TOKEN,
    JobRefused,
    SeenIds,
    ThrottledLog,
    check_job,
    compat_info,
    job_bytes_limit,
    warn_if_open,
)
from pdserve.engine.kv_connector import AbortJob, AddJob, ConnectorEvent, KVConnector
from pdserve.model.stored_quant import resolve_quantization
from pdserve.protocol import PD_CANCEL, PD_CHUNK_LAYER, PD_PREFILL, PD_REQUEST_FAILED, PrefillJob, unpack
from pdserve.protocol.pd import Accepted, Cancel, CancelAck, Done, Failed, LayerWritten, PDMessage, Started
from pdserve.utils.net import with_host
from pdserve.utils.signing import sign, token_key, verified

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine, RequestOutput
    from pdserve.engine.request import Request

log = logging.getLogger(__name__)


class PrefillConnector(KVConnector):
    def __init__(
        self,
        config: Config,
        kv_cache,
        bootstrap_endpoint: str,
        advertise_host: str | None = None,
        internal_token: str | None = None,
        kv_layout: str = "",
    ) -> None:
        """`advertise_host`: the host decode workers reach this one at (see utils/net.py).
        `internal_token`: jobs and cancels must be signed with it (None: nothing is checked).
        `kv_layout`: the model's ModelArch.kv_layout_name (a decode worker's must equal it)."""
        self.config = config
        self.block_size = config.cache.block_size
        self.model = served_names(config)[0]
        self.src = raw_bytes_view(kv_cache)
        self.key = token_key(internal_token)
        self.compat = compat_info(
            self.model,
            config.model.dtype,
            resolve_quantization(getattr(config.model, "quantization", "none"), config.model.name),
            self.block_size,
            list(kv_cache.shape),
            kv_cache.element_size(),
            kv_layout,
        )
        self._seen = SeenIds()  # engine thread only
        self._log_refused, self._log_rejected = (
            ThrottledLog(log),
            ThrottledLog(log),
        )  # bootstrap, engine thread
        d = config.disagg
        self.deadlines = Deadlines(d.bootstrap_timeout_s, d.queue_timeout_s, d.transfer_timeout_s)
        self._keepalive = LivenessClock(d.transfer_timeout_s / 3)  # re-acks of queued jobs
        # The sender thread must get the GIL soon after a layer lands; the default 5 ms switch
        # interval would leave each layer's copy waiting behind the engine's Python code.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self.backend = config.transfer.backend
        self.layerwise = config.transfer.layerwise
        self._computed_layers: list[int] = []
        self._last_layer_at = 0.0
        self._writes_done_at = 0.0  # set by the sender thread when a step's writes are all out
        self.throttle = Throttle(
            parse_bandwidth_limit(config.transfer.bandwidth_limit, measure_memcpy_bytes_per_s())
            if config.transfer.bandwidth_limit
            else None
        )
        self.sinks: dict[str, KVSink] = {}  # engine thread only
        self.chunks = ChunkPipeline(self.src, self.block_size, d.transfer_timeout_s, d.queue_timeout_s)
        self._spans: dict[str, Any] = {}  # engine thread only: each job's trace span (tracing on)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[SenderOp] = queue.SimpleQueue()
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._liveness = LivenessClock()
        self.stats_lock = threading.Lock()
        self.counters = {
            "kv_send_bytes_total": 0,
            "kv_send_seconds_total": 0.0,
            "kv_send_layers_total": 0,
            "kv_send_layer_lag_seconds_total": 0.0,
            "kv_send_layer_lag_seconds_max": 0.0,
            # From the last layer's compute to every write of the step done: what layer-wise
            # transfer leaves exposed (the whole transfer when it is not layer-wise).
            "kv_send_tail_lag_seconds_total": 0.0,
            "kv_send_steps_total": 0,
            "kv_prefill_jobs_total": 0,
            "kv_prefill_jobs_failed_total": 0,
            "kv_prefill_jobs_refused_total": 0,
            "kv_messages_rejected_total": 0,
        }
        self.reply_sockets = ReplySockets(
            self._ctx, configure=lambda s: s.setsockopt(zmq.SNDHWM, 100_000)
        )  # sender thread
        self._bootstrap = self._ctx.socket(zmq.PULL)
        self._bootstrap.setsockopt(zmq.LINGER, 0)
        # A peer may not stream more than a legitimate job can be before the HMAC is even checked:
        # past this, ZeroMQ drops the frame and the connection. A job is no longer than this pool.
        self._bootstrap.setsockopt(
            zmq.MAXMSGSIZE, job_bytes_limit(kv_cache.shape[2], self.block_size, config.vision)
        )
        bind_again(self._bootstrap, bootstrap_endpoint)  # the port a closed connector held, maybe
        warn_if_open(self._bootstrap.getsockopt_string(zmq.LAST_ENDPOINT), self.key)
        self.endpoint = with_host(self._bootstrap.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        # Started here so a missing package fails the worker at start, not each job; used by the
        # sender thread only from then on.
        self._writers = WriterFactory(
            self.src,
            self.block_size,
            self.backend,
            self.key,
            self.deadlines.transfer_s,
            open_endpoint(
                self.backend,
                endpoint_host(self.endpoint),
                f"pdserve-prefill-{HOST}-{os.getpid()}-{id(self):x}",
                self.src,
            ),
        )
        self._threads = [
            threading.Thread(target=self._bootstrap_loop, name="pd-bootstrap", daemon=True),
            threading.Thread(target=sender_loop, args=(self,), name="pd-sender", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ bootstrap thread

    def _bootstrap_loop(self) -> None:
        while not self._stop.is_set():
            if not self._bootstrap.poll(100):
                continue
            try:
                msg = unpack(self._bootstrap.recv())
            except (ValueError, Exception) as e:  # noqa: BLE001 - a bad peer message must not kill the thread
                log.warning("dropping a malformed control message: %s", e)
                continue
            if msg["type"] not in (PD_PREFILL, PD_CANCEL, PD_CHUNK_LAYER) or not isinstance(
                msg.get("request_id"), str
            ):
                continue  # the engine thread keys on request_id: it must be a string
            if not verified(msg, self.key):
                self._refuse_unsigned(msg)
                continue
            try:
                if msg["type"] == PD_CHUNK_LAYER:  # an earlier chunk's layer is in: a waiting job goes on
                    self.chunks.wire(msg)
                else:  # a job stays a map until the engine thread reads it: a bad one is answered from there
                    cancel = Cancel.from_wire(msg) if msg["type"] == PD_CANCEL else None
                    if cancel is not None:
                        self.chunks.board.cancel(cancel.transfer_id)  # ends a wait for an earlier chunk
                    self._inbox.put(cancel or msg)
                    self.chunks.board.changed.set()
            except ValueError as e:
                log.warning("dropping a malformed %s message: %s", msg["type"], e)
                continue
            self.wake()

    def _refuse_unsigned(self, msg: dict[str, Any]) -> None:
        """Never run, never act on, never answered: an answer would go where an unauthenticated sender
        chose (a socket, a connection to any host). A misconfigured decode worker learns from its
        bootstrap deadline, and this worker's log says why."""
        with self.stats_lock:
            self.counters["kv_messages_rejected_total"] += 1
        self._log_refused(
            logging.ERROR,
            "ignoring a %s message (request %s): %s",
            msg["type"],
            msg.get("request_id"),
            BAD_TOKEN,
        )

    def _send(self, job: PrefillJob, kind: type[PDMessage], **fields: Any) -> None:
        self._reply(job.reply_endpoint, kind(job.request_id, job.transfer_id, **fields))

    def _reply(self, endpoint: str, msg: PDMessage) -> None:
        self._outbox.put(SendMessage(endpoint, sign(msg.to_wire(), self.key)))

    # ------------------------------------------------------------------ engine thread hooks

    def has_work(self) -> bool:
        return not self._inbox.empty() or bool(self.chunks.parked)

    def wait(self, timeout: float) -> None:
        self.chunks.board.changed.wait(timeout)  # a job, a cancel or an earlier chunk's layer arrived

    def poll(self, engine: LLMEngine) -> list[ConnectorEvent]:
        """New jobs to add, cancels and jobs whose decode worker died or whose deadline passed to abort."""
        now = time.monotonic()
        events: list[ConnectorEvent] = []
        while not self._inbox.empty():
            msg = self._inbox.get_nowait()
            if isinstance(msg, Cancel):
                rid, tid = msg.request_id, msg.transfer_id
                sink = self.sinks.get(rid)
                if sink is not None and sink.job.transfer_id == tid:
                    sink.cancelled = True
                    events.append(AbortJob(rid))  # on_finished sends the ack
                else:
                    self.chunks.unpark(rid, tid)
                    self._reply(msg.reply_endpoint, CancelAck(rid, tid))
                continue
            try:
                job = PrefillJob.from_wire(msg)
                check_job(job, self.compat, self.key is not None, self._seen, time.time())
                self.chunks.check(job, self.backend)
                # One new token: output number len(job.output_token_ids), after the ones given.
                params = SamplingParams(
                    **{
                        **job.sampling,
                        "max_tokens": len(job.output_token_ids) + 1,
                        "stop": [],
                        "stop_token_ids": [],
                        "ignore_eos": True,
                    }
                )
                sink = KVSink(job, Transfer(job.request_id, self.deadlines, now), job.dst_start_block)
                sink.transfer.on("accepted", now)
                kwargs = {
                    "cache_salt": job.cache_salt,
                    "kv_sink": sink,
                    "output_token_ids": job.output_token_ids,
                    "images": [ImageInput.from_wire(d) for d in job.images],
                }
            except Exception as e:  # noqa: BLE001 - answered to the decode worker
                self._refuse(msg, e)
                continue
            ev = self.chunks.admit(
                AddJob(
                    job.request_id,
                    job.prompt_token_ids,
                    params,
                    kwargs,
                    accepted=functools.partial(self._accepted, job, sink),
                    refused=functools.partial(self._refuse, msg),
                ),
                sink,
                now,
            )
            if ev is not None:
                events.append(ev)
            else:  # parked: the decode worker hears it is queued
                self._send(job, Accepted, pid=os.getpid(), host=HOST)
        ready, expired = self.chunks.released(now)
        events += ready
        for sink, why in expired:
            self._send(sink.job, Failed, reason=why)
        check_pids = self._liveness.due(now)
        keepalive = self._keepalive.due(now)
        for rid, sink in list(self.sinks.items()):
            dead = check_pids and process_gone(sink.job.decode_pid, sink.job.decode_host)
            if dead or sink.transfer.expired(now):
                sink.transfer.fail(
                    "decode worker died" if dead else f"deadline in {sink.transfer.state.value}", now
                )
                events.append(AbortJob(rid))
            elif keepalive and sink.transfer.state == TransferState.WAITING:
                # Still queued here: the decode worker gives up on a peer silent for its transfer deadline.
                self._send(sink.job, Accepted, pid=os.getpid(), host=HOST)
        for p in self.chunks.parked.values() if keepalive else ():
            self._send(p.sink.job, Accepted, pid=os.getpid(), host=HOST)
        return events

    def _accepted(self, job: PrefillJob, sink: KVSink) -> None:
        """The engine took the job (engine thread, from AddJob)."""
        self.sinks[job.request_id] = sink
        if job.traceparent:
            self._spans[job.request_id] = tracing.start(
                "prefill.job",
                job.traceparent,
                transfer_id=job.transfer_id,
                prompt_tokens=len(job.prompt_token_ids),
            )
        with self.stats_lock:
            self.counters["kv_prefill_jobs_total"] += 1
        self._send(job, Accepted, pid=os.getpid(), host=HOST)

    def _refuse(self, msg: dict, e: Exception) -> None:
        """A job this worker or its engine will not run: the decode worker hears why."""
        code = e.code if isinstance(e, JobRefused) else None
        self._log_rejected(
            logging.ERROR if code else logging.WARNING,
            "rejecting prefill job %s: %s",
            msg.get("request_id"),
            e,
        )
        if code:
            with self.stats_lock:
                self.counters["kv_prefill_jobs_refused_total"] += 1
        self._reply(
            msg.get("reply_endpoint", ""), Failed(msg.get("request_id"), msg.get("transfer_id"), str(e), code)
        )

    def begin_step(self, scheduled: list[tuple[Request, int]]) -> list[Request]:
        """Plan this step's writes; returns the requests that have a sink."""
        bs = self.block_size
        planned = []
        now = time.monotonic()
        for req, n in scheduled:
            sink: KVSink | None = req.kv_sink
            if sink is None:
                continue
            start = req.num_computed_tokens
            if sink.transfer.state == TransferState.WAITING:
                sink.transfer.on("started", now)
                self._send(sink.job, Started)
            first = max(min(sink.next_block, start // bs), sink.job.dst_start_block)
            last = min((start + n - 1) // bs, len(sink.job.dst_block_ids) - 1)
            sink.plan = coalesce(req.block_ids[first : last + 1], sink.job.dst_block_ids[first : last + 1])
            sink.plan_end = (start + n) // bs
            planned.append(req)
        self.chunks.plan(scheduled)
        self.chunks.before_layer(planned, 0)
        return planned

    def on_layer(self, planned: list[Request], layer: int) -> None:
        now = time.monotonic()
        self._last_layer_at = now
        if not self.layerwise:
            self._computed_layers.append(layer)
        for req in planned if self.layerwise else ():
            self._write(req.kv_sink, layer, now)
        if layer + 1 < self.src.shape[0]:
            self.chunks.before_layer(planned, layer + 1)

    def _write(self, sink: KVSink, layer: int, computed_at: float) -> None:
        """Queue a layer's write, then (a pipelined chunk's last step) the next chunk's signal after it."""
        if sink.plan:
            self._outbox.put(WriteLayer(sink, layer, sink.plan, computed_at))
        if (m := self.chunks.signal(sink, layer)) is not None and sink.job.downstream_endpoint:
            self._reply(sink.job.downstream_endpoint, m)

    def end_step(self, planned: list[Request]) -> None:
        if not planned:
            return
        for layer in self._computed_layers:  # not layer-wise: every layer goes now
            for req in planned:
                self._write(req.kv_sink, layer, self._last_layer_at)
        self._computed_layers.clear()
        done = threading.Event()
        sinks = [r.kv_sink for r in planned]
        self._outbox.put(Barrier(done, sinks))
        if not done.wait(self.deadlines.transfer_s):
            for s in sinks:
                s.fail("writes did not finish before the transfer deadline")
        now = time.monotonic()
        with self.stats_lock:
            self.counters["kv_send_tail_lag_seconds_total"] += max(
                0.0, self._writes_done_at - self._last_layer_at
            )
            self.counters["kv_send_steps_total"] += 1
        for req in planned:
            sink = req.kv_sink
            sink.next_block = max(sink.next_block, sink.plan_end)
            if sink.error is None:
                sink.transfer.on("progress", now)
                self._send(sink.job, LayerWritten, upto_block=sink.next_block)

    def failed_requests(self) -> list[str]:
        return [rid for rid, s in self.sinks.items() if s.error is not None]

    def on_finished(self, req: Request, out: RequestOutput) -> None:
        """The request left the prefill engine: report the first token, or the failure."""
        sink = self.sinks.pop(req.request_id, None)
        if sink is None:
            return
        span = self._spans.pop(req.request_id, None)
        if span is not None:
            span.set_attribute("bytes_sent", sink.bytes_sent)
            tracing.end(
                span,
                None
                if out.finish_reason in ("length", "stop") and sink.error is None
                else sink.error or sink.transfer.reason or f"prefill ended: {out.finish_reason}",
            )
        self._outbox.put(CloseWriter(sink))
        self.chunks.finished(sink)
        now = time.monotonic()
        if sink.cancelled:
            self._send(sink.job, CancelAck)
        elif out.finish_reason in ("length", "stop") and sink.error is None and out.new_token_ids:
            sink.transfer.on("done", now)
            lp = out.new_logprobs[0] if out.new_logprobs else None
            self._send(
                sink.job,
                Done,
                token=out.new_token_ids[0],
                logprob=None if lp is None else lp.to_wire(),
                prompt_logprobs=None
                if req.prompt_logprobs is None
                else [None if e is None else e.to_wire() for e in req.prompt_logprobs],
                bytes=sink.bytes_sent,
                seconds=now - sink.transfer.started_at,
            )
        else:
            reason = sink.error or sink.transfer.reason or out.error or f"prefill ended: {out.finish_reason}"
            # out.error without a transfer error: the request's own step failed (engine._fail).
            own = out.error is not None and sink.error is None and sink.transfer.reason is None
            sink.transfer.fail(reason, now)
            with self.stats_lock:
                self.counters["kv_prefill_jobs_failed_total"] += 1
            self._send(sink.job, Failed, reason=reason, code=PD_REQUEST_FAILED if own else None)

    def stats(self) -> dict[str, float]:
        with self.stats_lock:
            out = dict(self.counters)
        out["kv_prefill_jobs_active"] = len(self.sinks)
        out["kv_reply_sockets_open"] = len(self.reply_sockets)
        # Derived gauges (Prometheus can also take rates of the counters).
        secs, layers = out["kv_send_seconds_total"], out["kv_send_layers_total"]
        out["kv_send_gbps"] = out["kv_send_bytes_total"] / secs / 1e9 if secs else 0.0
        out["kv_send_layer_lag_seconds_mean"] = (
            out["kv_send_layer_lag_seconds_total"] / layers if layers else 0.0
        )
        return out

    def close(self) -> None:
        self._stop.set()
        self._outbox.put(StopSender())
        for t in self._threads:
            t.join(timeout=2)
        self._bootstrap.close(0)
        if not self._threads[1].is_alive():  # no write in flight
            self._writers.close()
