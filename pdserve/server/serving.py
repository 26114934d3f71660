"""Bind the serving socket and run uvicorn: shared by the workers and the router, so torch-free
(the router must not import the engine; tests/test_import_contracts.py)."""

from __future__ import annotations

from pdserve.config import Config


def bind_socket(host: str, port: int):
    """The serving socket, bound now (port 0: any free port) but not yet listening. Binding before
    the slow start-up (model loading) keeps the port ours; listening only when uvicorn serves
    (asyncio's create_server calls listen) means a client that connects during start-up is
    refused at once instead of having its TCP (or TLS) handshake hang until the app is ready.

    TCP_NODELAY on it, and its protocol named: asyncio turns Nagle's algorithm off only on sockets
    whose protocol is IPPROTO_TCP, and a socket made with protocol 0 (the default) passes that on to
    every connection it accepts. With Nagle on, a reply's body (written after its headers) and each
    streamed chunk wait for the client's ACK of the previous write, which a delayed ACK holds back
    for up to 40 ms: every keep-alive request paid it in TTFT and a stream's tokens arrived in bursts."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_uvicorn(app, config: Config, tls: bool = False, sock=None) -> None:
    """Serve `app` until SIGTERM or SIGINT; SIGTERM drains and exits 0. With `tls`, HTTPS with the
    router's certificate (workers speak plain HTTP on the internal network)."""
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM is the normal way to stop a worker: drain, then exit 0 rather than re-raise it.
            if sig == signal.SIGTERM and not self.should_exit:
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    rc = config.router
    if tls and bool(rc.tls_cert) != bool(rc.tls_key):
        raise ValueError("router.tls_cert and router.tls_key go together")
    ssl = {"ssl_certfile": rc.tls_cert, "ssl_keyfile": rc.tls_key} if tls and rc.tls_cert else {}
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level="info",
            timeout_graceful_shutdown=int(config.server.shutdown_timeout_s),
            **ssl,
        )
    )
    server.run(sockets=[sock] if sock is not None else None)
