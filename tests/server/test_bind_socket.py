"""The serving socket is bound at start-up but listens only once uvicorn serves: a client that
connects while the model loads is refused at once (and retries), instead of having its TCP or TLS
handshake hang on a socket nobody accepts from (the router's test_tls saw a 2.3 s handshake)."""

from __future__ import annotations

import socket

import pytest

from pdserve.server.app import bind_socket


def test_bound_socket_refuses_until_served():
    sock = bind_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        # The port stays ours: another bind of it fails while we hold it.
        other = socket.socket()
        try:
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        finally:
            other.close()
        sock.listen(8)  # what asyncio's create_server does when uvicorn starts serving
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        sock.close()
