"""Router security: API keys (stored hashed, compared in constant time), per-key token buckets for
requests and tokens per minute (rate_limit.py), an IP allowlist, and one audit log line per request.

Who may call which route (client keys, admin keys, the internal token) is decided in access.py.
"""

from __future__ import annotations

import contextvars
import ipaddress
import logging
import time

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.common import tracing
from pdserve.protocol import INTERNAL_TOKEN_HEADER
from pdserve.router.access import Access, path_kind
from pdserve.router.rate_limit import RateLimiter
from pdserve.server.errors import error_response

audit = logging.getLogger("pdserve.audit")
# The key id of the request being served, for charging its tokens when it finishes.
current_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_key", default=None)
# When the request reached the router (perf_counter), for the router-overhead histogram.
arrived_at: contextvars.ContextVar[float | None] = contextvars.ContextVar("pdserve_arrived", default=None)


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

    def __init__(
        self, app: ASGIApp, access: Access, allowlist: Allowlist, limiter: RateLimiter, on_reject=None
    ) -> None:
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
                    reject = error_response(
                        429,
                        "rate limit exceeded for this key",
                        code="rate_limit_exceeded",
                        headers={"Retry-After": str(max(1, int(wait + 0.999)))},
                    )
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
            audit.info(
                "key=%s client=%s %s %s status=%d ms=%.1f%s",
                key or "-",
                client,
                scope.get("method"),
                path,
                status["code"],
                (time.monotonic() - start) * 1e3,
                f" trace={trace_id}" if trace_id else "",
            )
