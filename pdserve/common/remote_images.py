"""Fetching an http(s) image URL for a client (`vision.allow_remote_urls`) without becoming its proxy
into the server's network.

Each hop's host is resolved once, and every address it resolves to must be public: private,
loopback, link-local, multicast, reserved and unspecified addresses are refused, IPv4 ones hidden in
IPv6 (mapped, 6to4, Teredo, NAT64) included, unless `allow_networks` names them. The connection goes
to the address that was checked, never through a second lookup (a name that resolves to a public
address for the check and a private one for the connection gets nowhere). Redirects are followed
here, at most `MAX_REDIRECTS`, to http(s) only, each checked like the first URL. One deadline bounds
the whole fetch (lookups, connections, every read) and `max_bytes` the body. Whatever fails, the
client reads one sentence (anything more would map the network for it); the log has the reason.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable, Sequence
from urllib.parse import urljoin, urlsplit

from pdserve.common.images import ImageError

log = logging.getLogger(__name__)
MAX_REDIRECTS = 3
FETCH_FAILED = "could not fetch the image"
_REDIRECTS = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
Resolver = Callable[[str, int], Sequence[str]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class _Refused(Exception):
    """Why a fetch failed, for the log only."""


def system_resolve(host: str, port: int) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def _embedded(ip: IPAddress) -> list[IPAddress]:
    """The address and the IPv4 addresses an IPv6 one carries to a v4 host."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]  # an IPv4 address in IPv6 clothes: its own flags are the v4 ones
    out: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.sixtofour is not None:
            out.append(ip.sixtofour)
        if ip.teredo is not None:
            out.extend(ip.teredo)
        if ip in _NAT64:
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def _public(a: IPAddress) -> bool:
    if (
        a.is_private
        or a.is_loopback
        or a.is_link_local
        or a.is_multicast
        or a.is_reserved
        or a.is_unspecified
    ):
        return False
    if isinstance(a, ipaddress.IPv6Address) and a.is_site_local:
        return False
    return a.is_global


def address_allowed(address: str, allow_networks: Sequence[Network] = ()) -> bool:
    """A public unicast address, or one inside a network the operator allowed."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is link-local anyway
    if any(ip in net for net in allow_networks):
        return True
    return all(_public(a) for a in _embedded(ip))


def parse_networks(cidrs: Sequence[str]) -> list[Network]:
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise _Refused("the fetch's deadline passed")
        return left


class _Reader(io.RawIOBase):
    """The socket as http.client reads it, each read bounded by what is left of the deadline (a
    socket timeout alone bounds one read; a server dripping a byte at a time would outlast it)."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        self.sock.settimeout(self.deadline.left())
        return self.sock.recv_into(buf)


class _Socket:
    """What http.client uses of its socket, over one already connected to the checked address."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        self.sock.settimeout(self.deadline.left())  # since 3.5 the timeout bounds the whole sendall
        self.sock.sendall(data)

    def makefile(self, mode: str, *args, **kwargs) -> io.BufferedReader:
        return io.BufferedReader(_Reader(self.sock, self.deadline))

    def close(self) -> None:
        pass  # http.client closes it before the body is read; _get closes the socket after


class _Pinned(http.client.HTTPConnection):
    """HTTP to `host` (its Host header, its certificate) over a socket connected beforehand."""

    def __init__(self, host: str, port: int, sock: _Socket) -> None:
        super().__init__(host, port)
        self._pinned = sock

    def connect(self) -> None:
        self.sock = self._pinned


def _resolve(resolve: Resolver, host: str, port: int, deadline: _Deadline) -> list[str]:
    """`resolve` under the deadline: getaddrinfo has no timeout of its own, so it runs on a daemon
    thread (one stuck in a lookup neither holds the request nor the process's exit)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["addresses"] = list(resolve(host, port))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="pdserve-image-dns", daemon=True).start()
    if not done.wait(deadline.left()):
        raise _Refused(f"resolving {host!r} took too long")
    if "error" in box:
        raise _Refused(f"resolving {host!r}: {box['error']}")
    return box["addresses"]


def checked_addresses(
    host: str,
    port: int,
    resolve: Resolver,
    allow_networks: Sequence[Network],
    deadline: _Deadline | None = None,
) -> list[str]:
    """`host`'s addresses when every one is allowed; _Refused otherwise."""
    addresses = _resolve(resolve, host, port, deadline or _Deadline(30.0))
    if not addresses:
        raise _Refused(f"{host!r} has no address")
    refused = [a for a in addresses if not address_allowed(a, allow_networks)]
    if refused:
        raise _Refused(f"{host!r} resolves to {', '.join(refused)}, not a public address")
    return addresses


def _connect(addresses: list[str], port: int, deadline: _Deadline) -> socket.socket:
    last: Exception = _Refused("no address")
    for a in addresses:
        try:
            return socket.create_connection((a, port), timeout=deadline.left())
        except OSError as e:
            last = e
    raise _Refused(f"connecting to {addresses} port {port}: {last}")


def _get(
    url: str, max_bytes: int, resolve: Resolver, allow_networks: Sequence[Network], deadline: _Deadline
) -> tuple[int, str | None, bytes]:
    """One hop: (status, Location, body)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Refused(f"not an http(s) URL: {url[:200]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise _Refused(f"bad port in {url[:200]!r}") from None
    host = parts.hostname
    raw = _connect(checked_addresses(host, port, resolve, allow_networks, deadline), port, deadline)
    try:
        if parts.scheme == "https":
            raw.settimeout(deadline.left())
            raw = ssl.create_default_context().wrap_socket(raw, server_hostname=host)
        conn = _Pinned(host, port, _Socket(raw, deadline))
        conn.request(
            "GET",
            (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
            headers={"User-Agent": "pdserve", "Accept": "image/*", "Connection": "close"},
        )
        resp = conn.getresponse()
        if resp.status in _REDIRECTS:
            return resp.status, resp.getheader("Location"), b""
        if resp.status != 200:
            raise _Refused(f"{url[:200]!r} answered {resp.status}")
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise _Refused(f"{url[:200]!r} has {length} bytes, more than {max_bytes}")
        body = resp.read(max_bytes + 1)
        if len(body) > max_bytes:
            raise _Refused(f"{url[:200]!r} has more than {max_bytes} bytes")
        return resp.status, None, body
    finally:
        raw.close()


def fetch_image(
    url: str,
    max_bytes: int,
    timeout_s: float,
    allow_networks: Sequence[Network] = (),
    resolve: Resolver = system_resolve,
) -> bytes:
    """The bytes at `url`, or ImageError(FETCH_FAILED). `allow_networks`: networks reachable even
    though not public (an operator's own image store). Blocking: call it off the event loop."""
    deadline = _Deadline(timeout_s)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = _get(url, max_bytes, resolve, allow_networks, deadline)
            if location is None:
                if status in _REDIRECTS:
                    raise _Refused(f"{url[:200]!r} redirects without a Location")
                return body
            url = urljoin(url, location)
        raise _Refused(f"more than {MAX_REDIRECTS} redirects")
    except (_Refused, OSError, http.client.HTTPException, ValueError) as e:
        log.warning("remote image refused: %s", e)
        raise ImageError(FETCH_FAILED) from None
