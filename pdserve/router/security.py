"""Router security: API keys (stored hashed, compared in constant time), per-key token buckets for
requests and tokens per minute, an IP allowlist, and one audit log line per request.

Who may call which route (client keys, admin keys, the internal token) is decided in access.py.
"""
from __future__ import annotations

import contextvars
import ipaddress
import logging
import time
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.common import tracing
from pdserve.protocol import INTERNAL_TOKEN_HEADER
from pdserve.router.access import Access, KeyStore, hash_key, key_id, path_kind  # noqa: F401 (re-exported)
from pdserve.server.errors import error_response

audit = logging.getLogger("pdserve.audit")
# The key id of the request being served, for charging its tokens when it finishes.
current_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_key", default=None)
# When the request reached the router (perf_counter), for the router-overhead histogram.
arrived_at: contextvars.ContextVar[float | None] = contextvars.ContextVar("pdserve_arrived", default=None)


@dataclass
class Bucket:
    """A token bucket refilled continuously at `per_minute / 60` per second, holding at most `per_minute`."""
    per_minute: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60.0 / self.per_minute)


class RateLimiter:
    """Requests per minute are taken at admission; tokens per minute are charged when a request ends
    (its size is known then) and a key whose bucket is empty waits for it to refill."""

    def __init__(self, rpm: int | None, tpm: int | None) -> None:
        self.rpm, self.tpm = rpm, tpm
        self.requests: dict[str, Bucket] = {}
        self.tokens: dict[str, Bucket] = {}

    def _bucket(self, table: dict[str, Bucket], who: str, per_minute: float, now: float) -> Bucket:
        b = table.get(who)
        if b is None:
            if len(table) > 100_000:        # bounded: forget idle full buckets first
                for k in [k for k, v in table.items() if v.level >= v.per_minute][:50_000]:
                    del table[k]
            b = table[who] = Bucket(per_minute, per_minute, now)
        b.refill(now)
        return b

    def admit(self, who: str, now: float) -> float:
        """0 when admitted, else the seconds to wait (for Retry-After)."""
        if self.tpm:
            t = self._bucket(self.tokens, who, self.tpm, now)
            if t.level <= 0:
                return t.seconds_until(1)
        if self.rpm:
            r = self._bucket(self.requests, who, self.rpm, now)
            if r.level < 1:
                return r.seconds_until(1)
            r.level -= 1
        return 0.0

    async def check(self, who: str, now: float) -> float:
        """admit() as the middleware calls it (shared_limits.py decides in Redis instead)."""
        return self.admit(who, now)

    def charge_tokens(self, who: str, n: int, now: float) -> None:
        if self.tpm:
            self._bucket(self.tokens, who, self.tpm, now).level -= n


class Allowlist:
    def __init__(self, cidrs: list[str]) -> None:
        self.networks = [ipaddress.ip_network(c, strict=False) for c in cidrs]

    def allows(self, host: str | None) -> bool:
        if not self.networks:
            return True
        try:
            ip = ipaddress.ip_address(host or "")
        except ValueError:
            return False
        return any(ip in n for n in self.networks)


class SecurityMiddleware:
    """Pure ASGI (streaming bodies pass through untouched): allowlist, key, rate limit, audit line."""

    def __init__(self, app: ASGIApp, access: Access, allowlist: Allowlist, limiter: RateLimiter,
                 on_reject=None) -> None:
        self.app, self.access, self.allowlist, self.limiter = app, access, allowlist, limiter
        self.on_reject = on_reject or (lambda status: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        path = scope["path"]
        kind = path_kind(path)
        client = (scope.get("client") or (None, None))[0]
        who, key = client or "unknown", None
        status = {"code": 0}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        reject: Response | None = None
        trace_id = None
        if kind != "open":
            if not self.allowlist.allows(client):
                reject = error_response(403, "your address is not allowed here", code="ip_not_allowed")
            else:
                headers = dict(scope.get("headers") or [])
                auth = headers.get(b"authorization", b"").decode(errors="replace")
                presented = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
                verdict = self.access.check(path, presented, headers.get(INTERNAL_TOKEN_HEADER.encode(), b""))
                reject, key = verdict.reject, verdict.key
                who = key or who
            # Workers' registrations and heartbeats come every health period: not a client's budget.
            if reject is None and kind != "registration":
                wait = await self.limiter.check(who, time.monotonic())
                if wait > 0:
                    reject = error_response(429, "rate limit exceeded for this key", code="rate_limit_exceeded",
                                            headers={"Retry-After": str(max(1, int(wait + 0.999)))})
        if reject is not None:
            self.on_reject(reject.status_code)
            await reject(scope, receive, send_status)
        else:
            token, t_token = current_key.set(who), arrived_at.set(time.perf_counter())
            try:
                # The request's root span (tracing on): queueing, routing and each worker attempt are its children.
                with tracing.span(f"{scope.get('method')} {path}", **{"pdserve.key": key or "-"}):
                    trace_id = tracing.trace_id()
                    await self.app(scope, receive, send_status)
            finally:
                current_key.reset(token)
                arrived_at.reset(t_token)
        if kind != "open":
            audit.info("key=%s client=%s %s %s status=%d ms=%.1f%s", key or "-",
                       client, scope.get("method"), path, status["code"], (time.monotonic() - start) * 1e3,
                       f" trace={trace_id}" if trace_id else "")
