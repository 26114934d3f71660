"""The decode worker's side: ask a prefill worker to fill pre-allocated blocks, track the transfer.

The I/O thread owns the sockets: it receives control messages (and, over tcp, KV frames, which it
writes straight into the blocks of live transfers) and sends jobs and cancels the engine thread
hands it over an inproc socket. The engine thread owns every transfer's state machine and every
block: it polls, applies deadlines, and frees blocks.

Blocks of a failed shm, mooncake or nixl transfer (one-sided writes) are quarantined: a prefill worker
that is slow rather than dead could still write into them, so they stay allocated until it
acknowledges the cancel, its process is gone, or the quarantine deadline passes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import zmq

from pdserve.cache.kv_cache import raw_bytes_view
from pdserve.common import tracing
from pdserve.config import Config, served_names
from pdserve.disagg.binding import bind_again
from pdserve.disagg.parallel import ParallelLoads
from pdserve.disagg.peer import HOST, LivenessClock, process_gone
from pdserve.disagg.reply_sockets import ReplySockets
from pdserve.disagg.state import Deadlines, Transfer, TransferState
from pdserve.disagg.transports import endpoint_host, open_endpoint, transport
from pdserve.disagg.trust import (
    BAD_TOKEN,
    ThrottledLog,
    compat_info,
    done_problem,
    kv_frame_limit,
    warn_if_open,
)
from pdserve.disagg.write_gate import WriteGate, drain
from pdserve.engine.kv_connector import (
    BlocksFreed,
    ConnectorEvent,
    KVConnector,
    LoadDone,
    LoadFailed,
    LoadRetry,
)
from pdserve.engine.request import TokenLogprob
from pdserve.model.stored_quant import resolve_quantization
from pdserve.protocol import (
    PD_ACCEPTED,
    PD_INCOMPATIBLE,
    PD_LAYER,
    PD_REQUEST_FAILED,
    PD_STARTED,
    PD_TOO_LONG,
    PrefillJob,
    pack,
    unpack,
)
from pdserve.protocol.pd import Accepted, Cancel, CancelAck, Done, Failed, LayerFrames, PDMessage, decode_pd
from pdserve.utils.net import with_host
from pdserve.utils.signing import sign, token_key, verified

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import Request

log = logging.getLogger(__name__)
_EVENT_FOR = {PD_ACCEPTED: "accepted", PD_STARTED: "started", PD_LAYER: "progress"}
# A peer that refuses a job for these reasons would refuse it from any decode worker alike: the
# request fails with the reason instead of being retried or prefilled here behind a config error.
_FATAL = (PD_INCOMPATIBLE, PD_TOO_LONG, PD_REQUEST_FAILED)


@dataclass
class Pending:
    req: Request
    peer: str
    transfer: Transfer
    transfer_id: str
    peer_pid: int | None = None
    peer_host: str | None = None
    span: Any = None  # the transfer's trace span (tracing on)


class DecodeConnector(KVConnector):
    def __init__(
        self,
        config: Config,
        kv_cache: torch.Tensor,
        shm_path: str | None,
        bind_endpoint: str,
        advertise_host: str | None = None,
        internal_token: str | None = None,
        max_model_len: int = 0,
        attention_weight: float = 0.0,
        kv_layout: str = "",
    ) -> None:
        """`advertise_host`: the host prefill workers reach this one at (see utils/net.py).
        `internal_token`: jobs are signed with it and peers' messages must be (None: nothing is).
        `max_model_len`: this engine's context, which a prefill worker checks the prompt against.
        `attention_weight`: split.attention_weight of the model (where parallel.py cuts long prompts).
        `kv_layout`: the model's ModelArch.kv_layout_name, which a prefill worker's must equal."""
        self.config = config
        self.model = served_names(config)[0]
        self.block_size = config.cache.block_size
        self.kv_shape = list(kv_cache.shape)
        self.elem_size = kv_cache.element_size()
        self.key = token_key(internal_token)
        self.max_model_len = max_model_len
        self.compat = compat_info(
            self.model,
            config.model.dtype,
            resolve_quantization(getattr(config.model, "quantization", "none"), config.model.name),
            self.block_size,
            self.kv_shape,
            self.elem_size,
            kv_layout,
        )
        self.raw = raw_bytes_view(kv_cache)
        self.shm_path = shm_path
        d = config.disagg
        # A queued job's peer keeps it alive; silent for a transfer's deadline, it is gone.
        self.deadlines = Deadlines(
            d.bootstrap_timeout_s, d.queue_timeout_s, d.transfer_timeout_s, silence_s=d.transfer_timeout_s
        )
        self.peers = list(d.prefill_endpoints)
        self.pending: dict[str, Pending] = {}  # engine thread only
        self.quarantine: dict[
            str, tuple[list[int], float, Pending]
        ] = {}  # transfer id -> (blocks, deadline, pend)
        self.peer_down_until: dict[str, float] = {}
        self.counters = {
            "kv_transfers_completed_total": 0,
            "kv_transfers_failed_total": 0,
            "kv_transfer_bytes_total": 0,
            "kv_transfer_seconds_total": 0.0,
            "kv_recv_tcp_bytes_total": 0,
            "kv_local_prefill_fallbacks_total": 0,
            # Unsigned or wrongly signed; for a transfer not live (or blocks not its own).
            "kv_messages_rejected_total": 0,
            "kv_messages_dropped_total": 0,
        }
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._event = threading.Event()
        self._gate = WriteGate()  # which blocks tcp frames may fill (both threads)
        self._log_io, self._log_engine = ThrottledLog(log), ThrottledLog(log)  # one per thread
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # Past a legitimate frame's size ZeroMQ drops the frame and the connection, before any HMAC check.
        self._pull.setsockopt(
            zmq.MAXMSGSIZE,
            kv_frame_limit(
                self.raw.shape[2], self.raw.shape[3] * self.raw.shape[4], self.block_size, max_model_len
            ),
        )
        bind_again(self._pull, bind_endpoint)  # the port a closed connector held, maybe
        warn_if_open(self._pull.getsockopt_string(zmq.LAST_ENDPOINT), self.key)
        self.endpoint = with_host(self._pull.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        # mooncake, nixl: prefill workers write into the registered pool one-sidedly; nothing here
        # receives those bytes, PD_DONE still says when they are all in.
        self.backend = config.transfer.backend
        self.pool_endpoint = open_endpoint(
            self.backend,
            endpoint_host(self.endpoint),
            f"pdserve-decode-{HOST}-{os.getpid()}-{id(self):x}",
            self.raw,
        )
        self._out_addr = f"inproc://pd-decode-out-{id(self)}"
        self._out_in = self._ctx.socket(zmq.PULL)
        self._out_in.bind(self._out_addr)
        self._out: zmq.Socket | None = None  # created on the engine thread at first use
        self._stop = threading.Event()
        self._liveness = LivenessClock()
        self.parallel = ParallelLoads(self, d.parallel_prefill_min_tokens, attention_weight)  # engine thread
        self._thread = threading.Thread(target=self._io_loop, name="pd-decode-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ I/O thread

    def _io_loop(self) -> None:
        socks = ReplySockets(self._ctx)  # to prefill peers, which the router may name
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._out_in, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            socks.sweep()
            if self._out_in in ready:
                endpoint, payload = self._out_in.recv_multipart()
                ep = endpoint.decode()
                try:
                    socks.get(ep).send(payload, zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError, ValueError):
                    sent = unpack(payload)  # a job or a cancel of ours
                    self._inbox.put(Failed(sent["request_id"], sent["transfer_id"], f"cannot send to {ep}"))
            if self._pull in ready:
                try:
                    self._receive()
                except Exception as e:  # noqa: BLE001 - a bad peer message must not kill the thread
                    drain(self._pull)
                    self._log_io(logging.WARNING, "dropping a malformed message: %s", e)
                self._event.set()
                self.wake()
        socks.close()

    def _receive(self) -> None:
        raw = unpack(self._pull.recv())
        msg = decode_pd(raw)  # ValueError for a malformed one (ids must be strings: the engine keys on them)
        if not verified(raw, self.key):
            drain(self._pull)
            self._count("kv_messages_rejected_total")
            self._log_io(
                logging.ERROR, "dropping a %s message for %s: %s", msg.TYPE, msg.request_id, BAD_TOKEN
            )
            return
        if isinstance(msg, LayerFrames):
            n = self._receive_frames(msg)
            if n is None:
                return
            msg.received_bytes = n
        self._inbox.put(msg)

    def _receive_frames(self, msg: LayerFrames) -> int | None:
        """Write the KV frames that follow a tcp layer header straight into the destination blocks:
        only a live transfer's, only the blocks it was given (None: dropped, nothing written)."""
        rid, tid = msg.request_id, msg.transfer_id
        n, unknown = self._gate.fill(
            self._pull, self.raw, self.block_size, self.kv_shape[0], rid, tid, msg.layer, msg.runs
        )
        drain(self._pull)
        if n is None:
            self._drop_log(self._log_io, "tcp KV", rid, tid, unknown)
        return n

    def _count(self, name: str) -> None:
        with self._gate.lock:  # both threads count these
            self.counters[name] += 1

    def _drop_log(self, logger: ThrottledLog, kind: str, rid, tid, unknown: bool) -> None:
        """A message for a transfer that ended (late, after a cancel: normal) or that this worker never
        started, or naming blocks not its own (a broken or hostile peer) is dropped."""
        self._count("kv_messages_dropped_total")
        if unknown:
            logger(
                logging.WARNING,
                "dropping a %s message for request %s: transfer %s is not one this worker "
                "started, or the blocks are not its own",
                kind,
                rid,
                tid,
            )
        else:
            log.debug("dropping a late %s message for request %s: transfer %s ended", kind, rid, tid)

    def _post_out(self, endpoint: str, msg: PrefillJob | Cancel) -> None:
        if self._out is None:
            self._out = self._ctx.socket(zmq.PUSH)
            self._out.connect(self._out_addr)
        self._out.send_multipart([endpoint.encode(), pack(sign(msg.to_wire(), self.key))])

    # ------------------------------------------------------------------ engine thread

    def has_work(self) -> bool:
        return not self._inbox.empty() or bool(self.pending) or bool(self.quarantine) or self.parallel.busy()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)
        self._event.clear()

    def healthy_peers(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [p for p in self.peers if self.peer_down_until.get(p, 0.0) <= now]

    def order_peers(self, preferred: str | None) -> list[str]:
        """The request's prefill candidates: the router's choice first (comma-separated: the workers it
        offers to pipeline a long prompt on, in order), then the other healthy ones."""
        named = list(dict.fromkeys(p for p in (preferred or "").split(",") if p))
        self.peers += [p for p in named if p not in self.peers]
        now = time.monotonic()
        first = [p for p in named if self.peer_down_until.get(p, 0.0) <= now]
        return first + [p for p in self.healthy_peers(now) if p not in first]

    def start_load(self, req: Request) -> None:
        now = time.monotonic()
        if self.parallel.start(req, now):  # a long prompt: chunks on several peers
            return
        peer = req.prefill_peers[0]
        tid = os.urandom(8).hex()
        span = tracing.start(
            "kv.transfer",
            tracing.recall(req.request_id),
            peer=peer,
            transfer_id=tid,
            blocks=len(req.block_ids) - req.num_cached_blocks,
        )
        job = self.job_for(req, tid, traceparent=tracing.traceparent_of(span))
        self.pending[req.request_id] = Pending(
            req, peer, Transfer(req.request_id, self.deadlines, now), tid, span=span
        )
        self.accept_writes(
            req.request_id, req.block_ids[req.num_cached_blocks :], tid
        )  # cached ones are shared
        self._post_out(peer, job)

    def job_for(self, req: Request, tid: str, **fields: Any) -> PrefillJob:
        """The job asking a prefill worker to fill `req`'s blocks (`fields`: PrefillJob's optional ones)."""
        sampling = {k: (list(v) if isinstance(v, list) else v) for k, v in req.params.__dict__.items()}
        return PrefillJob(
            req.request_id,
            list(req.prompt_token_ids),
            sampling,
            req.cache_salt,
            list(req.block_ids),
            req.num_cached_blocks,
            self.endpoint,
            os.getpid(),
            HOST,
            self.shm_path,
            self.kv_shape,
            self.elem_size,
            self.block_size,
            self.model,
            **self._pool_fields(),
            output_token_ids=list(req.output_token_ids),
            transfer_id=tid,
            issued_at=time.time(),
            max_model_len=self.max_model_len,
            compat=self.compat,
            images=[im.to_wire() for im in req.images],
            **fields,
        )

    def _pool_fields(self) -> dict:
        if self.pool_endpoint is None:
            return {}
        return transport(self.backend).pool_fields(self.pool_endpoint)

    def accept_writes(self, request_id: str, block_ids: list[int], transfer_id: str = "") -> None:
        """From now on, tcp KV frames of this transfer land in these blocks (and in no others)."""
        self._gate.open(request_id, transfer_id, block_ids)

    def _end_writes(self, pend: Pending) -> None:
        self._gate.close(pend.req.request_id, pend.transfer_id)

    def next_message(self, timeout: float) -> PDMessage | None:
        """The next message from a peer, as the engine would see it (benchmarks drive this directly)."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def _stop_writes(self, pend: Pending, reason: str, now: float) -> list[int]:
        """Stop the peer writing; returns the blocks held back (quarantined) until it provably can't."""
        rid = pend.req.request_id
        self._end_writes(pend)
        pend.transfer.fail(reason, now)
        self.counters["kv_transfers_failed_total"] += 1
        dead = process_gone(pend.peer_pid, pend.peer_host)
        if not dead:
            self._post_out(pend.peer, Cancel(rid, pend.transfer_id, self.endpoint))
        if dead or not (self.shm_path or self.pool_endpoint):
            return []  # over tcp nothing lands once the rid leaves _live; a dead peer writes nothing
        held = pend.req.block_ids[pend.req.num_cached_blocks :]
        if held:
            self.quarantine[pend.transfer_id] = (held, now + self.config.disagg.quarantine_timeout_s, pend)
        return held

    def cancel_load(self, req: Request) -> list[int]:
        if req.request_id in self.parallel.groups:
            return self.parallel.cancel(req, time.monotonic())
        pend = self.pending.pop(req.request_id, None)
        if pend is None:
            return []
        return self._stop_writes(pend, "cancelled", time.monotonic())

    def poll(self, engine: LLMEngine) -> list[ConnectorEvent]:
        """Peers' messages, deadlines and liveness as events; `engine` is not touched here."""
        now = time.monotonic()
        events: list[ConnectorEvent] = []
        while not self._inbox.empty():
            msg: PDMessage = self._inbox.get_nowait()
            rid, tid, t = msg.request_id, msg.transfer_id, msg.TYPE
            if self.parallel.owns(msg):
                events += self.parallel.on_message(msg, now, engine.arch.vocab_size)
                continue
            if isinstance(msg, CancelAck) and tid in self.quarantine:
                self._release(events, tid)
                continue
            pend = self.pending.get(rid)
            if pend is None or pend.transfer_id != tid or isinstance(msg, CancelAck):
                ended = self._gate.ended(tid)
                if not (ended and isinstance(msg, CancelAck)):  # an ack of a transfer that held nothing back
                    self._drop_log(self._log_engine, t, rid, tid, not ended)
                continue
            try:
                if isinstance(msg, Accepted):
                    pend.peer_pid, pend.peer_host = msg.pid, msg.host
                if t in _EVENT_FOR:
                    pend.transfer.on(_EVENT_FOR[t], now)
                    if isinstance(msg, LayerFrames):
                        self.counters["kv_recv_tcp_bytes_total"] += msg.received_bytes
                elif isinstance(msg, Done) and (
                    bad := done_problem(
                        msg,
                        engine.arch.vocab_size,
                        pend.req.prompt_token_ids if pend.req.collects_prompt else None,
                    )
                ):
                    # Its KV is as suspect as its token: the request ends, its blocks go back.
                    events.append(self._fail_request(pend, f"prefill worker {pend.peer} sent {bad}", now))
                elif isinstance(msg, Done):
                    pend.transfer.on("done", now)
                    del self.pending[rid]
                    self._end_writes(pend)
                    self.counters["kv_transfers_completed_total"] += 1
                    self.counters["kv_transfer_bytes_total"] += msg.bytes
                    # Job lifetime (queue + compute + writes); the prefill side reports link GB/s.
                    self.counters["kv_transfer_seconds_total"] += now - pend.transfer.started_at
                    tracing.end(pend.span)
                    events.append(
                        LoadDone(
                            pend.req,
                            msg.token,
                            _logprob_or_none(msg.logprob),
                            None
                            if not pend.req.collects_prompt
                            else [None, *(TokenLogprob.from_wire(e) for e in msg.prompt_logprobs[1:])],
                        )
                    )
                elif isinstance(msg, Failed) and msg.code in _FATAL:
                    events.append(
                        self._fail_request(
                            pend, f"prefill worker {pend.peer} refused the request: {msg.reason}", now
                        )
                    )
                elif isinstance(msg, Failed):
                    events.append(self._fail(pend, f"prefill worker failed: {msg.reason}", now))
            except Exception as e:  # noqa: BLE001 - an out-of-order peer fails its transfer
                events.append(self._fail(pend, str(e), now))
        check_pids = self._liveness.due(now)
        for pend in list(self.pending.values()):
            dead = check_pids and process_gone(pend.peer_pid, pend.peer_host)
            if dead:
                events.append(self._fail(pend, "prefill worker died", now))
            elif pend.transfer.expired(now):
                # A prefill worker answers no job it cannot verify: silence at bootstrap may be a token mismatch.
                hint = (
                    f" (if it logs a bad token: {BAD_TOKEN})"
                    if pend.transfer.state == TransferState.BOOTSTRAPPING
                    else ""
                )
                events.append(self._fail(pend, f"no answer in state {pend.transfer.state.value}{hint}", now))
        for tid, (_, deadline, pend) in list(self.quarantine.items()):
            if now > deadline or (check_pids and process_gone(pend.peer_pid, pend.peer_host)):
                self._release(events, tid)
        return events + self.parallel.tick(now, check_pids)

    def _fail_request(self, pend: Pending, reason: str, now: float) -> LoadFailed:
        """No peer or retry would do better: the request ends with `reason` for its client."""
        log.error("request %s failed: %s", pend.req.request_id, reason)
        tracing.end(pend.span, reason)
        self.pending.pop(pend.req.request_id, None)
        held = self._stop_writes(pend, reason, now)
        return LoadFailed(pend.req, held, reason)

    def _fail(self, pend: Pending, reason: str, now: float) -> LoadRetry:
        rid = pend.req.request_id
        log.warning("KV transfer of %s from %s failed: %s", rid, pend.peer, reason)
        tracing.end(pend.span, reason)
        self.pending.pop(rid, None)
        self.peer_down_until[pend.peer] = now + self.config.disagg.peer_retry_s
        held = self._stop_writes(pend, reason, now)
        pend.req.prefill_peers = [p for p in self.healthy_peers(now) if p != pend.peer]
        if not pend.req.prefill_peers:
            self.counters["kv_local_prefill_fallbacks_total"] += 1
        return LoadRetry(pend.req, held)

    def _release(self, events: list[ConnectorEvent], transfer_id: str) -> None:
        entry = self.quarantine.pop(transfer_id, None)
        if entry is not None:
            events.append(BlocksFreed(entry[0]))

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        for state in TransferState:
            if state not in (TransferState.DONE, TransferState.FAILED):
                out[f"kv_transfers_{state.value}"] = sum(
                    1 for p in self.pending.values() if p.transfer.state == state
                )
        out["kv_blocks_quarantined"] = (
            sum(len(b) for b, _, _ in self.quarantine.values()) + self.parallel.held_blocks()
        )
        return {**out, **self.parallel.stats()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self._out is not None:
            self._out.close(0)
        self._pull.close(0)
        self._out_in.close(0)
        if self.pool_endpoint is not None:
            self.pool_endpoint.close()


def _logprob_or_none(entry: list | None) -> TokenLogprob | None:
    return None if entry is None else TokenLogprob.from_wire(entry)
