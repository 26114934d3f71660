"""KV transports behind one interface (base.Transport, base.KVWriter), one per file, chosen by name
from transfer.backend through this registry:

- shm (shm.py): the decode pool is a /dev/shm file the prefill worker maps and copies into;
- tcp (tcp.py): raw ZeroMQ frames received straight into the decode worker's blocks;
- mooncake (mooncake.py), nixl (nixl.py): optional extras, one-sided writes into a registered pool.

"auto" is shm for a decode worker on this host with a shared pool, tcp otherwise (per job)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.disagg.transports.base import (
    KVWriter,
    RemoteWriter,
    Run,
    Throttle,
    Transport,
    coalesce,
    endpoint_host,
    measure_memcpy_bytes_per_s,
    parse_bandwidth_limit,
)
from pdserve.disagg.transports.mooncake import MooncakeTransport
from pdserve.disagg.transports.nixl import NixlTransport
from pdserve.disagg.transports.shm import ShmTransport
from pdserve.disagg.transports.tcp import TcpTransport

TRANSPORTS: dict[str, Transport] = {
    t.name: t for t in (ShmTransport(), TcpTransport(), MooncakeTransport(), NixlTransport())
}


def transport(name: str) -> Transport:
    """The transport of this backend name (not "auto", which each job resolves)."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORTS)}") from None


def open_endpoint(backend: str, host: str, name: str, buf: np.ndarray) -> Any:
    """The one-sided endpoint `backend` needs at start (a missing package fails the worker then, not
    each job); None for backends that need none."""
    return TRANSPORTS[backend].open_endpoint(host, name, buf) if backend in TRANSPORTS else None


__all__ = [
    "TRANSPORTS",
    "KVWriter",
    "RemoteWriter",
    "Run",
    "Throttle",
    "Transport",
    "coalesce",
    "endpoint_host",
    "measure_memcpy_bytes_per_s",
    "open_endpoint",
    "parse_bandwidth_limit",
    "transport",
]
