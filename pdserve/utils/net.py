"""Addresses other processes use to reach this one.

A worker that binds every interface (`--host 0.0.0.0`, as in a container) cannot hand "0.0.0.0"
to its router or its peers. It advertises `server.advertise_host` instead (flag
`--advertise-host`, or the environment variable PDSERVE_ADVERTISE_HOST, which a Kubernetes pod
fills from `status.podIP`); without one, a wildcard bind advertises this machine's address.
"""

from __future__ import annotations

import os
import socket

WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::")


def advertise_host(bind_host: str, configured: str | None = None) -> str:
    """The host name or address peers should use for sockets bound on `bind_host`."""
    chosen = configured or os.environ.get("PDSERVE_ADVERTISE_HOST")
    if chosen:
        return chosen
    if bind_host in WILDCARD_HOSTS:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return bind_host


def with_host(endpoint: str, host: str | None) -> str:
    """`scheme://host:port` with its host replaced (IPv6 addresses bracketed); endpoints without a
    host (ipc://, inproc://), or no host given, come back unchanged."""
    scheme, rest = endpoint.split("://", 1)
    if not host or scheme not in ("tcp", "http", "https"):
        return endpoint
    port = rest.rsplit(":", 1)[1]
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
