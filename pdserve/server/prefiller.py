"""llm-d's prefill header on a decode worker: `x-prefiller-host-port: HOST:PORT` names a prefill
worker by its HTTP address, where pdserve's router names its KV endpoint (`x-pdserve-prefill`).

The decode worker asks that address's `/health` (open on every worker) for the worker's role and
`kv_endpoint`, keeps the answer for TTL_S (a failed lookup for FAILED_TTL_S, so a bad header costs one
deadline, not one per request), and then proceeds as with pdserve's header. A value that does not
parse, an address that does not answer within LOOKUP_TIMEOUT_S, or a worker that is not a prefill
worker gives None: the decode worker prefills the prompt itself, as with no header at all.

What the header can make the worker do is bounded: one GET of `/health` at the address given, and a
KV job sent only to a worker that signs its messages with the internal token (disagg/trust.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time

import httpx

from pdserve.server.openai_api import LLMD_PREFILL_HEADER

log = logging.getLogger(__name__)

TTL_S = 30.0
FAILED_TTL_S = 5.0
LOOKUP_TIMEOUT_S = 2.0
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def parse_host_port(value: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `[v6]:port`; None for anything else (a URL, a path, a user)."""
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
        return host, int(port)
    if not _HOST.fullmatch(host):
        return None
    return host, int(port)


class PrefillerResolver:
    """HTTP address of a prefill worker -> its KV endpoint, cached; concurrent lookups share one call."""

    def __init__(self, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._cache: dict[str, tuple[str | None, float]] = {}  # host:port -> (kv endpoint, expiry)
        self._pending: dict[str, asyncio.Future] = {}
        self._client: httpx.AsyncClient | None = None
        self.lookups = 0
        self.failures = 0

    async def resolve(self, value: str | None) -> str | None:
        if not value:
            return None
        parsed = parse_host_port(value)
        if parsed is None:
            log.warning("ignoring %s %r: not HOST:PORT", LLMD_PREFILL_HEADER, value[:100])
            return None
        key = f"{parsed[0]}:{parsed[1]}"
        hit = self._cache.get(key)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(key))
            self._pending[key] = pending
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        return await asyncio.shield(pending)

    async def _lookup(self, key: str) -> str | None:
        self.lookups += 1
        endpoint, why = None, ""
        try:
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=self.timeout_s)
            # The deadline covers connecting, the answer and reading it.
            r = await asyncio.wait_for(self._client.get(f"http://{key}/health"), self.timeout_s)
            body = r.json() if r.status_code == 200 else {}
            if not isinstance(body, dict):
                why = "its /health is not a JSON object"
            elif body.get("role") != "prefill":
                why = f"it is not a prefill worker (status {r.status_code}, role {body.get('role')!r})"
            elif not isinstance(body.get("kv_endpoint"), str) or not body["kv_endpoint"]:
                why = "it reports no kv_endpoint"
            else:
                endpoint = body["kv_endpoint"]
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
        if endpoint is None:
            self.failures += 1
            log.warning("%s %s: prefilling locally (%s)", LLMD_PREFILL_HEADER, key, why)
        self._cache[key] = (endpoint, time.monotonic() + (TTL_S if endpoint else FAILED_TTL_S))
        return endpoint

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
