"""The decode worker's side of a pipelined long prompt: one request, several prefill workers, one chunk each.

A prompt with at least `disagg.parallel_prefill_min_tokens` uncached tokens, and at least two
healthy prefill peers, is cut into chunks of about equal compute (split.py). Each chunk's job names
the decode blocks of the whole prompt (the later chunks read the earlier chunks' KV there,
pipeline.py), starts writing at its own first block, and tells the next chunk's worker when each
layer is in. The request is loaded when every chunk is done; the last chunk's token is its first.

Any chunk's failure (a refusal, a deadline, a dead peer) fails them all: the live ones are cancelled,
the request's blocks stay quarantined until each of those peers acknowledges (or is gone, or the
quarantine deadline passes), since one may still write or read them, and the request goes back to
the queue without the peer to blame: with two healthy peers left it is pipelined again, with one it
is prefilled by that one alone, with none locally.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.disagg.peer import process_gone
from pdserve.disagg.split import pipeline_parts, split_points
from pdserve.disagg.state import Transfer
from pdserve.disagg.trust import done_problem
from pdserve.engine.kv_connector import BlocksFreed, ConnectorEvent, LoadDone, LoadFailed, LoadRetry
from pdserve.engine.request import TokenLogprob
from pdserve.protocol import PD_INCOMPATIBLE, PD_REQUEST_FAILED, PD_TOO_LONG
from pdserve.protocol.pd import Accepted, Cancel, CancelAck, Done, Failed, LayerWritten, PDMessage, Started

if TYPE_CHECKING:
    from pdserve.disagg.receiver import DecodeConnector
    from pdserve.engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class Part:
    peer: str
    transfer: Transfer
    transfer_id: str
    peer_pid: int | None = None
    peer_host: str | None = None
    done: bool = False


@dataclass
class Group:
    req: Request
    parts: list[Part]
    token: int | None = None
    logprob: TokenLogprob | None = None


@dataclass
class Held:
    """A failed group's blocks, held until no part's peer can touch them."""

    blocks: list[int]
    deadline: float
    waiting: dict[str, Part] = field(default_factory=dict)  # transfer id -> a part not acknowledged yet


class ParallelLoads:
    def __init__(self, conn: DecodeConnector, min_tokens: int, attention_weight: float) -> None:
        self.conn = conn
        self.min_tokens = min_tokens
        self.weight = attention_weight
        self.groups: dict[str, Group] = {}  # request id -> (engine thread only)
        self.held: dict[str, Held] = {}  # the group's first transfer id ->
        self._held_by_tid: dict[str, str] = {}  # a waiting part's transfer id -> its `held` key
        self.counters = {
            "kv_parallel_prefills_total": 0,
            "kv_parallel_prefill_chunks_total": 0,
            "kv_parallel_prefills_failed_total": 0,
        }

    def busy(self) -> bool:
        return bool(self.groups or self.held)

    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self.held.values())

    def start(self, req: Request, now: float) -> bool:
        """Send `req`'s chunks to its first peers, if it is long enough and they are enough; False: not pipelined."""
        c = self.conn
        bs = c.block_size
        start = req.num_cached_blocks * bs
        parts = pipeline_parts(req.num_tokens - start, len(req.prefill_peers), self.min_tokens)
        # Prompt logprobs come whole from one peer: such a request is not split.
        if parts < 2 or not c.shm_path or req.images or req.output_token_ids or req.collects_prompt:
            return False
        cuts = split_points(start, req.num_tokens, parts, bs, self.weight)
        if len(cuts) < 3:
            return False
        peers = req.prefill_peers[: len(cuts) - 1]
        tids = [os.urandom(8).hex() for _ in peers]
        group = Group(
            req, [Part(p, Transfer(req.request_id, c.deadlines, now), t) for p, t in zip(peers, tids)]
        )
        self.groups[req.request_id] = group
        for k, (peer, tid) in enumerate(zip(peers, tids)):
            lo, hi = cuts[k], cuts[k + 1]
            last = k == len(peers) - 1
            job = c.job_for(
                req,
                tid,
                upstream_tokens=lo if k else 0,
                downstream_endpoint=None if last else peers[k + 1],
                downstream_transfer_id="" if last else tids[k + 1],
            )
            job.prompt_token_ids = job.prompt_token_ids[:hi]
            job.dst_block_ids = job.dst_block_ids[: -(-hi // bs)]
            job.dst_start_block = max(job.dst_start_block, lo // bs)
            c._post_out(peer, job)
        self.counters["kv_parallel_prefills_total"] += 1
        self.counters["kv_parallel_prefill_chunks_total"] += len(peers)
        log.info(
            "request %s: %d prompt tokens prefilled by %d workers, cut at %s",
            req.request_id,
            req.num_tokens - start,
            len(peers),
            cuts[1:-1],
        )
        return True

    def owns(self, msg: PDMessage) -> bool:
        g = self.groups.get(msg.request_id)
        return (
            g is not None and any(p.transfer_id == msg.transfer_id for p in g.parts)
        ) or msg.transfer_id in self._held_by_tid

    def on_message(self, msg: PDMessage, now: float, vocab_size: int) -> list[ConnectorEvent]:
        tid = msg.transfer_id
        key = self._held_by_tid.get(tid)
        if key is not None:  # a cancelled part: only its acknowledgement matters
            return self._acked(key, tid) if isinstance(msg, CancelAck) else []
        g = self.groups[msg.request_id]
        part = next(p for p in g.parts if p.transfer_id == tid)
        try:
            if isinstance(msg, Accepted):
                part.peer_pid, part.peer_host = msg.pid, msg.host
                part.transfer.on("accepted", now)
            elif isinstance(msg, Started):
                part.transfer.on("started", now)
            elif isinstance(msg, LayerWritten):
                part.transfer.on("progress", now)
            elif isinstance(msg, Done) and (bad := done_problem(msg, vocab_size)):
                return [self._fail(g, part, f"prefill worker {part.peer} sent {bad}", now, fatal=True)]
            elif isinstance(msg, Done):
                part.transfer.on("done", now)
                part.done = True
                self.conn.counters["kv_transfer_bytes_total"] += msg.bytes
                if part is g.parts[-1]:
                    g.token, g.logprob = (
                        msg.token,
                        None if msg.logprob is None else TokenLogprob.from_wire(msg.logprob),
                    )
                if all(p.done for p in g.parts):
                    del self.groups[g.req.request_id]
                    self.conn.counters["kv_transfers_completed_total"] += 1
                    self.conn.counters["kv_transfer_seconds_total"] += now - g.parts[0].transfer.started_at
                    assert g.token is not None  # every part's Done was checked
                    return [LoadDone(g.req, g.token, g.logprob)]
            elif isinstance(msg, Failed):
                return [
                    self._fail(
                        g,
                        part,
                        f"prefill worker {part.peer} failed a chunk: {msg.reason}",
                        now,
                        fatal=msg.code in (PD_INCOMPATIBLE, PD_TOO_LONG, PD_REQUEST_FAILED),
                    )
                ]
            else:
                return [self._fail(g, part, f"unexpected {msg.TYPE} message for a chunk", now)]
        except Exception as e:  # noqa: BLE001 - an out-of-order or broken peer fails its group, not the engine
            return [self._fail(g, part, f"{type(e).__name__}: {e}", now)]
        return []

    def tick(self, now: float, check_pids: bool) -> list[ConnectorEvent]:
        """Deadlines and dead peers of live groups; the end of held blocks' wait."""
        events: list[ConnectorEvent] = []
        for g in list(self.groups.values()):
            for part in g.parts:
                if part.done:
                    continue
                if check_pids and process_gone(part.peer_pid, part.peer_host):
                    events.append(self._fail(g, part, f"prefill worker {part.peer} died", now))
                    break
                if part.transfer.expired(now):
                    events.append(
                        self._fail(
                            g, part, f"no answer from {part.peer} in state {part.transfer.state.value}", now
                        )
                    )
                    break
        for key, h in list(self.held.items()):
            if now > h.deadline or (
                check_pids and all(process_gone(p.peer_pid, p.peer_host) for p in h.waiting.values())
            ):
                events += self._release(key)
        return events

    def cancel(self, req: Request, now: float) -> list[int]:
        """`req` leaves (aborted): stop every chunk; returns the blocks held back until they are stopped."""
        g = self.groups.pop(req.request_id)
        return self._stop(g, "cancelled", now)

    def _fail(self, g: Group, part: Part, reason: str, now: float, fatal: bool = False) -> ConnectorEvent:
        rid = g.req.request_id
        log.warning("pipelined prefill of %s failed: %s", rid, reason)
        self.groups.pop(rid, None)
        self.counters["kv_parallel_prefills_failed_total"] += 1
        held = self._stop(g, reason, now)
        if fatal:
            return LoadFailed(g.req, held, reason)
        c = self.conn
        c.peer_down_until[part.peer] = now + c.config.disagg.peer_retry_s
        g.req.prefill_peers = [p for p in c.healthy_peers(now) if p != part.peer]
        if not g.req.prefill_peers:
            c.counters["kv_local_prefill_fallbacks_total"] += 1
        return LoadRetry(g.req, held)

    def _stop(self, g: Group, reason: str, now: float) -> list[int]:
        """Cancel the chunks still running; hold the request's blocks until each has stopped."""
        c = self.conn
        c.counters["kv_transfers_failed_total"] += 1
        waiting: dict[str, Part] = {}
        for p in g.parts:
            p.transfer.fail(reason, now)
            if p.done or process_gone(p.peer_pid, p.peer_host):
                continue
            c._post_out(p.peer, Cancel(g.req.request_id, p.transfer_id, c.endpoint))
            waiting[p.transfer_id] = p
        blocks = g.req.block_ids[g.req.num_cached_blocks :]
        if not waiting or not blocks:
            return []
        key = g.parts[0].transfer_id
        self.held[key] = Held(list(blocks), now + c.config.disagg.quarantine_timeout_s, waiting)
        for tid in waiting:
            self._held_by_tid[tid] = key
        return list(blocks)

    def _acked(self, key: str, tid: str) -> list[ConnectorEvent]:
        h = self.held.get(key)
        self._held_by_tid.pop(tid, None)
        if h is None:
            return []
        h.waiting.pop(tid, None)
        return self._release(key) if not h.waiting else []

    def _release(self, key: str) -> list[ConnectorEvent]:
        h = self.held.pop(key, None)
        if h is None:
            return []
        for tid in h.waiting:
            self._held_by_tid.pop(tid, None)
        return [BlocksFreed(h.blocks)]

    def stats(self) -> dict[str, float]:
        return dict(self.counters)
