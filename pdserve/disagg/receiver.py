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
from typing import TYPE_CHECKING

import torch
import zmq

from pdserve.cache.kv_cache import raw_bytes_view
from pdserve.config import Config
from pdserve.disagg.peer import HOST, LivenessClock, process_gone
from pdserve.disagg.state import Deadlines, Transfer, TransferState
from pdserve.disagg.transport import MooncakeEndpoint, NixlEndpoint, endpoint_host
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.request import TokenLogprob
from pdserve.protocol import (
    PD_ACCEPTED,
    PD_CANCEL,
    PD_CANCEL_ACK,
    PD_DONE,
    PD_FAILED,
    PD_LAYER,
    PD_STARTED,
    PrefillJob,
    pack,
    unpack,
)
from pdserve.utils.net import with_host

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine, RequestOutput
    from pdserve.engine.request import Request

log = logging.getLogger(__name__)
_EVENT_FOR = {PD_ACCEPTED: "accepted", PD_STARTED: "started", PD_LAYER: "progress"}


@dataclass
class Pending:
    req: Request
    peer: str
    transfer: Transfer
    peer_pid: int | None = None
    peer_host: str | None = None


class DecodeConnector(KVConnector):
    def __init__(self, config: Config, kv_cache: torch.Tensor, shm_path: str | None, bind_endpoint: str,
                 advertise_host: str | None = None) -> None:
        """`advertise_host`: the host prefill workers reach this one at (see utils/net.py)."""
        self.config = config
        self.model = config.server.served_model_name or config.model.name
        self.block_size = config.cache.block_size
        self.kv_shape = list(kv_cache.shape)
        self.elem_size = kv_cache.element_size()
        self.raw = raw_bytes_view(kv_cache)
        self.shm_path = shm_path
        d = config.disagg
        self.deadlines = Deadlines(d.bootstrap_timeout_s, d.queue_timeout_s, d.transfer_timeout_s)
        self.peers = list(d.prefill_endpoints)
        self.pending: dict[str, Pending] = {}            # engine thread only
        self.quarantine: dict[str, tuple[list[int], float, Pending]] = {}   # rid -> (blocks, deadline, transfer)
        self.peer_down_until: dict[str, float] = {}
        self.counters = {"kv_transfers_completed_total": 0, "kv_transfers_failed_total": 0,
                         "kv_transfer_bytes_total": 0, "kv_transfer_seconds_total": 0.0,
                         "kv_recv_tcp_bytes_total": 0, "kv_local_prefill_fallbacks_total": 0}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._event = threading.Event()
        self._live: dict[str, list[int]] = {}            # rid -> destination blocks the I/O thread may write
        self._live_lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(bind_endpoint)
        self.endpoint = with_host(self._pull.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        # mooncake, nixl: prefill workers write into the registered pool one-sidedly; nothing here
        # receives those bytes, PD_DONE still says when they are all in.
        backend = config.transfer.backend
        self.pool_endpoint: MooncakeEndpoint | NixlEndpoint | None = None
        if backend == "mooncake":
            self.pool_endpoint = MooncakeEndpoint(endpoint_host(self.endpoint), self.raw)
        elif backend == "nixl":
            self.pool_endpoint = NixlEndpoint(f"pdserve-decode-{HOST}-{os.getpid()}-{id(self):x}", self.raw)
        self._out_addr = f"inproc://pd-decode-out-{id(self)}"
        self._out_in = self._ctx.socket(zmq.PULL)
        self._out_in.bind(self._out_addr)
        self._out: zmq.Socket | None = None              # created on the engine thread at first use
        self._stop = threading.Event()
        self._liveness = LivenessClock()
        self._thread = threading.Thread(target=self._io_loop, name="pd-decode-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ I/O thread

    def _io_loop(self) -> None:
        socks: dict[str, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._out_in, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._out_in in ready:
                endpoint, payload = self._out_in.recv_multipart()
                ep = endpoint.decode()
                s = socks.get(ep)
                if s is None:
                    s = socks[ep] = self._ctx.socket(zmq.PUSH)
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(ep)
                try:
                    s.send(payload, zmq.NOBLOCK)
                except zmq.Again:
                    self._inbox.put({"type": PD_FAILED, "request_id": unpack(payload).get("request_id"),
                                     "reason": f"cannot send to {ep}"})
            if self._pull in ready:
                try:
                    self._receive()
                except Exception as e:  # noqa: BLE001 - a bad peer message must not kill the thread
                    log.warning("dropping a malformed message: %s", e)
                self._event.set()
                self.wake()
        for s in socks.values():
            s.close(0)

    def _receive(self) -> None:
        msg = unpack(self._pull.recv())
        if msg["type"] == PD_LAYER and msg.get("data"):
            msg["bytes"] = self._receive_frames(msg)
        self._inbox.put(msg)

    def _receive_frames(self, msg: dict) -> int:
        """Write the KV frames that follow a tcp layer header straight into the destination blocks."""
        bs, n = self.block_size, 0
        with self._live_lock:
            live = msg["request_id"] in self._live
            for d, k in msg["runs"]:
                for kv in (0, 1):
                    if not self._pull.getsockopt(zmq.RCVMORE):
                        raise ValueError("a KV frame is missing")
                    view = self.raw[msg["layer"], kv, d * bs:(d + k) * bs]
                    if not live:
                        self._pull.recv()                    # cancelled: drain, write nothing
                        continue
                    got = self._pull.recv_into(view.reshape(-1))
                    if got != view.nbytes:
                        raise ValueError(f"KV frame of {got} bytes, expected {view.nbytes}")
                    n += got
            while self._pull.getsockopt(zmq.RCVMORE):
                self._pull.recv()
        return n

    def _post_out(self, endpoint: str, msg: dict) -> None:
        if self._out is None:
            self._out = self._ctx.socket(zmq.PUSH)
            self._out.connect(self._out_addr)
        self._out.send_multipart([endpoint.encode(), pack(msg)])

    # ------------------------------------------------------------------ engine thread

    def has_work(self) -> bool:
        return not self._inbox.empty() or bool(self.pending) or bool(self.quarantine)

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)
        self._event.clear()

    def healthy_peers(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [p for p in self.peers if self.peer_down_until.get(p, 0.0) <= now]

    def order_peers(self, preferred: str | None) -> list[str]:
        """The request's prefill candidates: the router's choice first, then the other healthy ones."""
        healthy = self.healthy_peers()
        if preferred and preferred not in self.peers:
            self.peers.append(preferred)
        if preferred and self.peer_down_until.get(preferred, 0.0) <= time.monotonic():
            return [preferred] + [p for p in healthy if p != preferred]
        return healthy

    def start_load(self, req: Request) -> None:
        now = time.monotonic()
        peer = req.prefill_peers[0]
        p = req.params
        sampling = {k: (list(v) if isinstance(v, list) else v) for k, v in p.__dict__.items()}
        job = PrefillJob(req.request_id, list(req.prompt_token_ids), sampling, req.cache_salt, list(req.block_ids),
                         req.num_cached_blocks, self.endpoint, os.getpid(), HOST, self.shm_path, self.kv_shape,
                         self.elem_size, self.block_size, self.model,
                         **self._pool_fields(), output_token_ids=list(req.output_token_ids))
        self.pending[req.request_id] = Pending(req, peer, Transfer(req.request_id, self.deadlines, now))
        self.accept_writes(req.request_id, req.block_ids)
        self._post_out(peer, job.to_wire())

    def _pool_fields(self) -> dict:
        ep = self.pool_endpoint
        if isinstance(ep, MooncakeEndpoint):
            return {"mooncake_session": ep.session_id, "pool_base": ep.base}
        if isinstance(ep, NixlEndpoint):
            return {"nixl_metadata": ep.metadata, "pool_base": ep.base}
        return {}

    def accept_writes(self, request_id: str, block_ids: list[int]) -> None:
        """From now on, tcp KV frames for this request land in these blocks."""
        with self._live_lock:
            self._live[request_id] = list(block_ids)

    def next_message(self, timeout: float) -> dict | None:
        """The next message from a peer, as the engine would see it (benchmarks drive this directly)."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def _stop_writes(self, pend: Pending, reason: str, now: float) -> list[int]:
        """Stop the peer writing; returns the blocks held back (quarantined) until it provably can't."""
        rid = pend.req.request_id
        with self._live_lock:
            self._live.pop(rid, None)
        pend.transfer.fail(reason, now)
        self.counters["kv_transfers_failed_total"] += 1
        dead = process_gone(pend.peer_pid, pend.peer_host)
        if not dead:
            self._post_out(pend.peer, {"type": PD_CANCEL, "request_id": rid, "reply_endpoint": self.endpoint})
        if dead or not (self.shm_path or self.pool_endpoint):
            return []       # over tcp nothing lands once the rid leaves _live; a dead peer writes nothing
        held = pend.req.block_ids[pend.req.num_cached_blocks:]
        if held:
            self.quarantine[rid] = (held, now + self.config.disagg.quarantine_timeout_s, pend)
        return held

    def cancel_load(self, req: Request) -> list[int]:
        pend = self.pending.pop(req.request_id, None)
        if pend is None:
            return []
        return self._stop_writes(pend, "cancelled", time.monotonic())

    def poll(self, engine: LLMEngine) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        while not self._inbox.empty():
            msg = self._inbox.get_nowait()
            rid = msg.get("request_id")
            if msg["type"] == PD_CANCEL_ACK:
                self._release(engine, rid)
                continue
            pend = self.pending.get(rid)
            if pend is None:
                continue                            # a late message for a transfer that ended
            t = msg["type"]
            try:
                if t == PD_ACCEPTED:
                    pend.peer_pid, pend.peer_host = msg.get("pid"), msg.get("host")
                if t in _EVENT_FOR:
                    pend.transfer.on(_EVENT_FOR[t], now)
                    self.counters["kv_recv_tcp_bytes_total"] += msg.get("bytes", 0)
                elif t == PD_DONE:
                    pend.transfer.on("done", now)
                    del self.pending[rid]
                    with self._live_lock:
                        self._live.pop(rid, None)
                    self.counters["kv_transfers_completed_total"] += 1
                    self.counters["kv_transfer_bytes_total"] += msg.get("bytes", 0)
                    # Job lifetime (queue + compute + writes); the prefill side reports link GB/s.
                    self.counters["kv_transfer_seconds_total"] += now - pend.transfer.started_at
                    outputs.append(engine.complete_load(pend.req, msg["token"], _logprob_or_none(msg.get("logprob"))))
                elif t == PD_FAILED:
                    self._fail(engine, pend, f"prefill worker failed: {msg.get('reason')}", now)
            except Exception as e:  # noqa: BLE001 - an out-of-order peer fails its transfer
                self._fail(engine, pend, str(e), now)
        check_pids = self._liveness.due(now)
        for pend in list(self.pending.values()):
            dead = check_pids and process_gone(pend.peer_pid, pend.peer_host)
            if dead:
                self._fail(engine, pend, "prefill worker died", now)
            elif pend.transfer.expired(now):
                self._fail(engine, pend, f"no answer in state {pend.transfer.state.value}", now)
        for rid, (_, deadline, pend) in list(self.quarantine.items()):
            if now > deadline or (check_pids and process_gone(pend.peer_pid, pend.peer_host)):
                self._release(engine, rid)
        return outputs

    def _fail(self, engine: LLMEngine, pend: Pending, reason: str, now: float) -> None:
        rid = pend.req.request_id
        log.warning("KV transfer of %s from %s failed: %s", rid, pend.peer, reason)
        self.pending.pop(rid, None)
        self.peer_down_until[pend.peer] = now + self.config.disagg.peer_retry_s
        held = self._stop_writes(pend, reason, now)
        pend.req.prefill_peers = [p for p in self.healthy_peers(now) if p != pend.peer]
        if not pend.req.prefill_peers:
            self.counters["kv_local_prefill_fallbacks_total"] += 1
        engine.retry_load(pend.req, held)

    def _release(self, engine: LLMEngine, rid: str) -> None:
        entry = self.quarantine.pop(rid, None)
        if entry is not None:
            engine.pool.free(entry[0])

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        for state in TransferState:
            if state not in (TransferState.DONE, TransferState.FAILED):
                out[f"kv_transfers_{state.value}"] = sum(1 for p in self.pending.values()
                                                         if p.transfer.state == state)
        out["kv_blocks_quarantined"] = sum(len(b) for b, _, _ in self.quarantine.values())
        return out

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
