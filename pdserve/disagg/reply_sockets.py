"""Outbound PUSH sockets of one thread, one per peer endpoint, bounded and expiring.

An endpoint comes from a peer's message (a job's reply_endpoint, a chunk's downstream_endpoint): a
socket per distinct endpoint, kept forever, would let ~1,000 messages exhaust the ZeroMQ context
and leave the worker reconnecting for good to hosts a sender chose. So at most `capacity` sockets
stay open, the least recently used one is closed first, and one idle for `idle_s` is closed at the
next sweep. A socket a live KV writer holds (`pin`) is never closed under it; closing drops what
is still queued (linger 0): a peer that takes nothing must not hold the worker up.

Both are bounds on a resource, not on traffic: a decode worker gets one socket, reused by every
job, so the capacity only matters when many peers (or a hostile one) name endpoints."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

CAPACITY = 64  # more decode workers than one prefill worker answers at a time
IDLE_S = 60.0  # reconnecting costs one handshake; a socket unused this long goes


class ReplySockets:
    """Not thread-safe: one owner thread (the pd-sender thread, the decode worker's I/O thread)."""

    def __init__(
        self,
        ctx: zmq.Context,
        capacity: int = CAPACITY,
        idle_s: float = IDLE_S,
        configure: Callable[[zmq.Socket], None] | None = None,
        clock=time.monotonic,
    ) -> None:
        self.ctx, self.capacity, self.idle_s, self.clock = ctx, capacity, idle_s, clock
        self.configure = configure
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self._used: dict[str, float] = {}
        self._pins: dict[str, int] = {}
        self._swept = clock()
        self.closed_total = 0

    def __len__(self) -> int:
        return len(self._socks)

    def get(self, endpoint: str) -> zmq.Socket:
        """The socket connected to `endpoint` (made now if needed: ValueError for one that is not a
        tcp/ipc/inproc address, before any socket exists)."""
        s = self._socks.get(endpoint)
        if s is None:
            if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"not an endpoint: {endpoint!r}")
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            if self.configure is not None:
                self.configure(s)
            try:
                s.connect(endpoint)
            except zmq.ZMQError:
                s.close(0)
                raise
            self._socks[endpoint] = s
            self._evict()
        else:
            self._socks.move_to_end(endpoint)
        self._used[endpoint] = self.clock()
        return s

    def pin(self, endpoint: str) -> zmq.Socket:
        """`get`, kept open until as many `unpin` calls (a writer's socket)."""
        s = self.get(endpoint)
        self._pins[endpoint] = self._pins.get(endpoint, 0) + 1
        return s

    def unpin(self, endpoint: str) -> None:
        n = self._pins.get(endpoint, 0) - 1
        if n > 0:
            self._pins[endpoint] = n
        else:
            self._pins.pop(endpoint, None)
            self._used[endpoint] = self.clock()

    def sweep(self) -> None:
        """Close the sockets idle for idle_s (call it often: it looks at most once a second)."""
        now = self.clock()
        if now - self._swept < 1.0:
            return
        self._swept, old = now, now - self.idle_s
        for ep in [ep for ep, t in self._used.items() if t < old and ep not in self._pins]:
            self._close(ep)

    def _evict(self) -> None:
        over = len(self._socks) - self.capacity
        for ep in [ep for ep in self._socks if ep not in self._pins][: max(0, over)]:
            self._close(ep)

    def _close(self, endpoint: str) -> None:
        s = self._socks.pop(endpoint, None)
        self._used.pop(endpoint, None)
        if s is not None:
            s.close(0)
            self.closed_total += 1

    def close(self) -> None:
        for ep in list(self._socks):
            self._close(ep)
