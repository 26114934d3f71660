"""The prefill worker's sender thread (see sender.py): it owns every outbound socket and every KV
writer, and does the writes and messages of the outbox in order, so that `done` never overtakes a layer."""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

import zmq

from pdserve.disagg.sink import Barrier, CloseWriter, SenderOp, SendMessage, StopSender, WriteLayer
from pdserve.disagg.trust import ThrottledLog
from pdserve.protocol import pack

if TYPE_CHECKING:
    from pdserve.disagg.sender import PrefillConnector

log = logging.getLogger("pdserve.disagg.sender")


def sender_loop(c: PrefillConnector) -> None:
    """The pd-sender thread: every write and outbound message of connector `c`, in its outbox's order."""
    socks = c.reply_sockets
    dirty: set[str] = set()  # sinks whose writer needs a flush at the next barrier
    last_write_at = 0.0
    warn = ThrottledLog(log)  # a reply to an endpoint a peer made up fails here, once per message

    while True:
        socks.sweep()  # idle reply sockets go, busy or not
        try:
            item: SenderOp = c._outbox.get(timeout=1.0)
        except queue.Empty:
            continue
        if isinstance(item, StopSender):
            break
        try:
            if isinstance(item, SendMessage):
                socks.get(item.endpoint).send(pack(item.wire), zmq.NOBLOCK)
            elif isinstance(item, WriteLayer):
                sink, computed_at = item.sink, item.computed_at
                if sink.cancelled or sink.error:
                    continue
                if sink.writer is None:
                    sink.writer = c._writers.make(sink.job, socks)
                t0 = time.monotonic()
                n = sink.writer.write_layer(sink.job.request_id, item.layer, item.runs)
                c.throttle.consume(n)
                t1 = last_write_at = time.monotonic()
                sink.bytes_sent += n
                dirty.add(sink.job.request_id)
                with c.stats_lock:
                    k = c.counters
                    k["kv_send_bytes_total"] += n
                    k["kv_send_seconds_total"] += t1 - t0
                    k["kv_send_layers_total"] += 1
                    k["kv_send_layer_lag_seconds_total"] += t1 - computed_at
                    k["kv_send_layer_lag_seconds_max"] = max(
                        k["kv_send_layer_lag_seconds_max"], t1 - computed_at
                    )
            elif isinstance(item, Barrier):
                # Writes that complete asynchronously (tcp) are only known done after the flush.
                done_at = last_write_at
                for sink in item.sinks:
                    if sink.writer is not None and sink.job.request_id in dirty and not sink.error:
                        try:
                            if sink.writer.flush():
                                done_at = time.monotonic()
                        except Exception as e:  # noqa: BLE001 - one stalled peer fails its own transfer
                            log.warning("KV transfer %s: flush failed: %s", sink.job.request_id, e)
                            sink.fail(f"flush failed: {e}")
                dirty.clear()
                c._writes_done_at = done_at
                item.done.set()
            elif isinstance(item, CloseWriter) and item.sink.writer is not None:
                item.sink.writer.close()
                item.sink.writer = None
        except Exception as e:  # noqa: BLE001 - a failed write fails its request, not the worker
            warn(logging.WARNING, "KV transfer %s failed: %s", type(item).__name__, e)
            if isinstance(item, WriteLayer):
                item.sink.fail(f"{type(e).__name__}: {e}")
            elif isinstance(item, Barrier):
                for sink in item.sinks:
                    sink.fail(f"flush failed: {e}")
                item.done.set()
    socks.close()
