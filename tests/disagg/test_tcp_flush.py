"""A tcp KV writer whose decode peer takes no bytes (nothing listens: a partition looks the same to
the sender) fails its flush within its timeout, instead of holding the prefill worker's one sender
thread, and with it every other transfer, for half a minute; a live peer's flush succeeds."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import zmq

from pdserve.disagg.transports.tcp import TcpWriter


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _writer(endpoint: str, timeout: float) -> tuple[TcpWriter, zmq.Socket]:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    # [layers, K/V, slots, heads, bytes per head]; runs of 16 blocks are 128 KiB frames, above the size
    # under which zmq copies a frame (and its tracker is done at once).
    src = np.zeros((2, 2, 1024, 8, 64), dtype=np.uint8)
    return TcpWriter(src, 16, push, None, "t1", flush_timeout_s=timeout), push


def test_flush_to_a_peer_that_takes_nothing_fails_in_time():
    w, push = _writer(_dead_endpoint(), 0.5)
    try:
        w.write_layer("r", 0, [(0, 0, 16)])
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="not taken"):
            w.flush()
        assert time.monotonic() - t0 < 5
        assert w.flush() is False  # nothing left to wait for
    finally:
        push.close(0)


def test_flush_to_a_live_peer():
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    w, push = _writer(f"tcp://127.0.0.1:{port}", 10)
    try:
        n = w.write_layer("r", 1, [(0, 0, 16)])
        assert w.flush() is True
        frames = pull.recv_multipart()
        assert len(frames) == 3 and len(frames[1]) + len(frames[2]) == n
    finally:
        push.close(0)
        pull.close(0)
