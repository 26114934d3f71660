"""The request body limit (`server.max_body_bytes`) of the router and of workers, every route included.

A declared Content-Length over the limit is refused before any byte is read. A body without one
(chunked transfer encoding) or with a false one is counted as it arrives: the first message that
takes it over the limit stops the reading, and the client gets a 413 with an OpenAI-style body;
the rest is never read, so it never lands in memory.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.server.errors import error_response


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once the body passes the limit. An HTTPException, so that FastAPI's
    body parsing lets it through instead of turning it into a 400."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body exceeds {max_bytes} bytes")


class BodySizeLimit:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    def _reject(self) -> JSONResponse:
        if self.on_reject is not None:
            self.on_reject()
        return error_response(413, f"the request body exceeds {self.max_bytes} bytes", code="body_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._reject()(scope, receive, send)
            return
        received = 0
        over = started = False

        async def counted_receive() -> Message:
            nonlocal received, over
            if over:  # a handler that caught the error and reads on: no more of the body
                raise BodyTooLarge(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over and not started:  # whatever the app answers to the error, the 413 below replaces it
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            pass
        if over and not started:
            await self._reject()(scope, receive, send)


def install_body_limit(app: FastAPI, max_bytes: int, on_reject: Callable[[], None] | None = None) -> None:
    """The middleware on every route of `app`, and a handler that keeps the error out of the app's
    generic HTTP error handler (the middleware answers and counts it, once)."""
    app.add_middleware(BodySizeLimit, max_bytes=max_bytes, on_reject=on_reject)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_response(413, str(exc.detail), code="body_too_large")
