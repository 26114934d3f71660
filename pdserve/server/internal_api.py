"""Worker endpoints for the router: token-level generation, and the internal token on every route.

`POST /internal/generate` streams NDJSON deltas of token ids (with logprobs when asked). The router
detokenizes, applies stop strings and speaks the OpenAI API; a router that closes the stream
aborts the request here, as any client disconnect does.
"""

from __future__ import annotations

import hashlib
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
from pdserve.common.internal_token import internal_token
from pdserve.common.sampling import SamplingParams, check_cache_salt
from pdserve.config import Config, ConfigError
from pdserve.protocol import INTERNAL_TOKEN_HEADER, InternalGenerateRequest
from pdserve.protocol.stream import TokenLine
from pdserve.server.errors import APIError, error_body, error_response
from pdserve.server.metrics import RequestTimer
from pdserve.server.openai_api import PREFILL_HEADER

if TYPE_CHECKING:  # the router imports this module (internal_token) and must not load the engine
    from pdserve.engine.async_engine import AsyncEngine


def worker_api_keys(configured: list[str]) -> list[str]:
    """server.worker_api_keys and PDSERVE_WORKER_API_KEYS (comma-separated) together."""
    env = [k.strip() for k in os.environ.get("PDSERVE_WORKER_API_KEYS", "").split(",") if k.strip()]
    return [*configured, *env]


def check_worker_keys(config: Config) -> None:
    """Raise ConfigError (naming server.worker_api_keys) for keys without an internal token: such a
    worker would gate its OpenAI API and leave /internal/* and the role switch open to anyone."""
    if worker_api_keys(config.server.worker_api_keys) and not internal_token(config.server.internal_token):
        raise ConfigError(
            [
                (
                    "server.worker_api_keys",
                    "worker API keys need an internal token (server.internal_token or "
                    "PDSERVE_INTERNAL_TOKEN): without one the internal routes would stay open",
                )
            ]
        )


# Probes and Prometheus scrape these without the secret; they only read state.
OPEN_PATHS = ("/health", "/metrics")
# What a worker API key reaches: the OpenAI API and tokenization, nothing internal.
_KEYED_PREFIXES = ("/v1/",)
_KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def keyed_path(path: str) -> bool:
    return path.startswith(_KEYED_PREFIXES) or path in _KEYED_PATHS


class RequireInternalToken:
    """Pure-ASGI gate: with a token configured, every route but OPEN_PATHS needs it; the OpenAI API
    (keyed_path) also takes a worker API key (`Authorization: Bearer`), which reaches nothing else."""

    def __init__(self, app: ASGIApp, token: str, keys: list[str] | None = None) -> None:
        self.app = app
        self.token = token.encode()
        self.keys = [hashlib.sha256(k.encode()).digest() for k in keys or []]

    def _key_ok(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"").decode(errors="replace")
        if not self.keys or not auth.lower().startswith("bearer "):
            return False
        d = hashlib.sha256(auth[7:].strip().encode()).digest()
        ok = False
        for stored in self.keys:  # every key compared, in constant time
            ok |= hmac.compare_digest(d, stored)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            given = headers.get(INTERNAL_TOKEN_HEADER.encode(), b"")
            if not hmac.compare_digest(given, self.token):
                keyed = keyed_path(scope["path"])
                if not (keyed and self._key_ok(headers)):
                    await self._refuse(keyed)(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _refuse(self, keyed: bool):
        if keyed and self.keys:
            return error_response(
                401,
                "a valid worker API key is required (Authorization: Bearer ...)",
                code="invalid_api_key",
            )
        return error_response(401, "this worker accepts requests from its router only", code="internal_token")


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
