"""Worker endpoints for the router: token-level generation, and the internal token on every route.

`POST /internal/generate` streams NDJSON deltas of token ids (with logprobs when asked). The router
detokenizes, applies stop strings and speaks the OpenAI API; a router that closes the stream
aborts the request here, as any client disconnect does.
"""

from __future__ import annotations

import hmac
import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.common import tracing
from pdserve.common.errors import (
    DuplicateRequestId,
    EngineDeadError,
    InvalidParam,
    RequestFailed,
    RequestMoved,
)
from pdserve.common.images import ImageInput
from pdserve.common.sampling import SamplingParams, check_cache_salt
from pdserve.protocol import INTERNAL_TOKEN_HEADER, InternalGenerateRequest
from pdserve.protocol.stream import TokenLine
from pdserve.server.errors import APIError, error_body, error_response
from pdserve.server.metrics import RequestTimer
from pdserve.server.openai_api import PREFILL_HEADER

if TYPE_CHECKING:  # the router imports this module (internal_token) and must not load the engine
    from pdserve.engine.async_engine import AsyncEngine


def internal_token(configured: str | None) -> str | None:
    return configured or os.environ.get("PDSERVE_INTERNAL_TOKEN") or None


# Probes and Prometheus scrape these without the secret; they only read state.
OPEN_PATHS = ("/health", "/metrics")


class RequireInternalToken:
    """Pure-ASGI gate: with a token configured, every route but OPEN_PATHS needs it."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(INTERNAL_TOKEN_HEADER.encode(), b"")
            if not hmac.compare_digest(given, self.token):
                await error_response(
                    401, "this worker accepts requests from its router only", code="internal_token"
                )(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_internal_routes(
    app: FastAPI, engine: AsyncEngine, timer: RequestTimer, refusal: Callable[[], str | None] | None = None
) -> None:
    """`refusal`: why new requests are refused now (None: they are taken)."""

    @app.post("/internal/generate")
    async def generate(req: InternalGenerateRequest, http: Request):
        if not engine.accepting:
            raise APIError(
                503, "the worker is shutting down", code="shutting_down", headers={"Retry-After": "1"}
            )
        if refusal is not None and (why := refusal()) is not None:
            raise APIError(503, why, code="switching_role", headers={"Retry-After": "1"})
        try:
            images = [ImageInput.from_json(d) for d in req.images]
        except ValueError as e:
            raise APIError(400, str(e), "images", "invalid_value") from e
        try:
            check_cache_salt(req.cache_salt)
            params = SamplingParams(**req.sampling)
            engine.engine.check_request(req.prompt_token_ids, params, req.output_token_ids, images)
        except TypeError as e:
            raise APIError(400, f"bad sampling parameters: {e}", "sampling", "invalid_value") from e
        except InvalidParam as e:
            raise APIError(400, str(e), e.param, "invalid_value") from e
        if engine.has_stream(req.request_id):
            raise APIError(
                409,
                f"request id {req.request_id!r} is already running on this worker",
                "request_id",
                "duplicate_request_id",
            )
        peer = http.headers.get(PREFILL_HEADER)
        timer.start(req.request_id, time.monotonic(), params.max_tokens)
        trace = http.headers.get(tracing.TRACEPARENT)  # the router's attempt: this worker's spans join it

        async def lines():
            t0 = time.time_ns()
            root = tracing.start(
                "worker.generate",
                trace,
                request_id=req.request_id,
                prompt_tokens=len(req.prompt_token_ids),
                tokens_so_far=len(req.output_token_ids),
            )
            tracing.remember(req.request_id, tracing.traceparent_of(root))  # the KV transfer's parent
            decode = None
            try:
                async for out in engine.generate(
                    req.request_id,
                    req.prompt_token_ids,
                    params,
                    req.cache_salt,
                    peer,
                    req.output_token_ids,
                    images,
                ):
                    if root is not None and decode is None:
                        # The first token: the prompt was prefilled (by a peer, its KV transferred, or here).
                        parent = tracing.traceparent_of(root)
                        tracing.end(
                            tracing.start(
                                "worker.prefill",
                                parent,
                                t0,
                                prefilled_by=out.prefilled_by or "local",
                                prefill_failed=list(out.prefill_failures or []),
                            )
                        )
                        decode = tracing.start("worker.decode", parent)
                    yield TokenLine(
                        out.new_token_ids,
                        [lp.to_wire() for lp in out.new_logprobs] or None,
                        out.finished,
                        out.finish_reason,
                        out.num_prompt_tokens,
                        out.prefilled_by,
                        out.prefill_failures,
                        None
                        if out.prompt_logprobs is None
                        else [lp.to_wire() if lp is not None else None for lp in out.prompt_logprobs],
                    ).encode()
            except DuplicateRequestId as e:  # came in while this handler was starting the stream
                yield json.dumps(error_body(409, str(e), "request_id", "duplicate_request_id")) + "\n"
            except InvalidParam as e:
                yield json.dumps(error_body(400, str(e), e.param, "invalid_value")) + "\n"
            except EngineDeadError as e:
                yield json.dumps(error_body(503, str(e), code="engine_dead")) + "\n"
            except RequestMoved as e:  # the router continues the stream on another worker
                yield json.dumps(error_body(503, str(e), code="moved")) + "\n"
            except RequestFailed as e:
                yield json.dumps(error_body(502, str(e), code="request_failed")) + "\n"
            finally:
                timer.forget(req.request_id)
                tracing.end(decode)
                tracing.end(root)
                tracing.forget(req.request_id)

        return StreamingResponse(lines(), media_type="application/x-ndjson")
