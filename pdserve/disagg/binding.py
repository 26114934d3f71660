"""Binding a worker's fixed KV port again after the socket that held it was closed.

ZeroMQ closes a socket asynchronously (its I/O thread releases the listening port a moment after
close() returns), so a role switch that closes one connector and binds the next one to the same
`worker.kv_port` can find the port still taken: seen as EADDRINUSE on a loaded machine, every time a
switch was retried. The bind is retried for a short deadline instead.
"""

from __future__ import annotations

import errno
import time

import zmq

BIND_DEADLINE_S = 5.0


def bind_again(sock: zmq.Socket, endpoint: str, deadline_s: float = BIND_DEADLINE_S) -> None:
    """sock.bind(endpoint), retried while the address is in use, for up to `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(0.05)
