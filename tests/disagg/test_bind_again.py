"""A connector's fixed KV port bound again right after the socket holding it was closed (what a role
switch does): ZeroMQ releases the port asynchronously, so a plain bind can find it taken; bind_again
waits for it. A port a live socket holds is still refused, after the deadline."""

from __future__ import annotations

import errno
import socket

import pytest
import zmq

from pdserve.disagg.binding import bind_again


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rebinding_a_just_closed_port_succeeds_every_time():
    ctx = zmq.Context.instance()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    held = ctx.socket(zmq.PULL)
    held.setsockopt(zmq.LINGER, 0)
    held.bind(endpoint)
    for i in range(100):  # alternate socket types, as a decode <-> prefill switch does
        held.close(0)
        held = ctx.socket(zmq.PULL if i % 2 else zmq.PUSH)
        held.setsockopt(zmq.LINGER, 0)
        bind_again(held, endpoint)
        assert held.getsockopt_string(zmq.LAST_ENDPOINT) == endpoint
    held.close(0)


def test_a_port_a_live_socket_holds_is_still_refused():
    ctx = zmq.Context.instance()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    owner, other = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    try:
        owner.bind(endpoint)
        with pytest.raises(zmq.ZMQError) as e:
            bind_again(other, endpoint, deadline_s=0.3)
        assert e.value.errno == errno.EADDRINUSE
    finally:
        owner.close(0)
        other.close(0)
