"""The serving socket is bound at start-up but listens only once uvicorn serves: a client that
connects while the model loads is refused at once (and retries), instead of having its TCP or TLS
handshake hang on a socket nobody accepts from (the router's test_tls saw a 2.3 s handshake). Its
connections send without waiting for ACKs (TCP_NODELAY)."""

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


def test_served_connections_send_without_waiting_for_acks():
    """Every connection asyncio (uvicorn) accepts on the socket has Nagle's algorithm off: with it on, a
    reply's body and each streamed chunk waited for the client's delayed ACK of the previous write (up
    to 40 ms a request on a keep-alive connection, and a stream's tokens arriving in bursts). asyncio
    turns it off itself only on sockets whose protocol is IPPROTO_TCP."""
    import asyncio

    async def accepted_nodelay() -> int:
        sock = bind_socket("127.0.0.1", 0)
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                conn = transport.get_extra_info("socket")
                got.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            port = sock.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(got, 10)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0
