"""The serving process of the mixed role: one engine behind the OpenAI-compatible API."""
from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve.config import Config
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.server.roles import build_engine
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, model_card
from pdserve.server.errors import BodySizeLimit, error_response, install_error_handlers
from pdserve.server.metrics import RequestTimer, ServerMetrics
from pdserve.server.openai_api import OpenAIHandlers

log = logging.getLogger(__name__)


def create_app(config: Config, engine: LLMEngine | None = None) -> FastAPI:
    engine = engine or build_engine(config)
    model_name = config.server.served_model_name or config.model.name
    metrics = ServerMetrics(engine.stats)
    timer = RequestTimer(metrics)
    async_engine = AsyncEngine(engine, on_output=timer.on_output)
    handlers = OpenAIHandlers(async_engine, engine.tokenizer, model_name, timer)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        yield
        # uvicorn has already let open connections finish (or cancelled them at its timeout).
        async_engine.shutdown(timeout=config.server.shutdown_timeout_s)
        engine.connector.close()
        engine.close()

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    app.state.engine = async_engine
    install_error_handlers(app, on_error=lambda status: metrics.errors.labels(str(status)).inc())

    app.add_middleware(BodySizeLimit, max_bytes=config.server.max_body_bytes,
                       on_reject=lambda: metrics.errors.labels("413").inc())

    @app.get("/health")
    async def health():
        if async_engine.dead is not None:
            return error_response(503, f"engine failed: {async_engine.dead}", code="engine_dead")
        if not async_engine.accepting:
            return error_response(503, "shutting down", code="shutting_down")
        return {"status": "ok", "role": config.worker.role, "pid": os.getpid(),
                "kv_endpoint": getattr(engine.connector, "endpoint", None), **engine.stats()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_name, engine.max_model_len)]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        return await handlers.completions(req, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request):
        return await handlers.chat(req, http)

    return app


def run_uvicorn(app, config: Config) -> None:
    """Serve `app` until SIGTERM or SIGINT; SIGTERM drains and exits 0."""
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM is the normal way to stop a worker: drain, then exit 0 rather than re-raise it.
            if sig == signal.SIGTERM and not self.should_exit:
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    GracefulServer(uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level="info",
                                  timeout_graceful_shutdown=int(config.server.shutdown_timeout_s))).run()


def serve(config: Config) -> None:
    app = create_app(config)
    log.info("serving %s (%s) on http://%s:%d", config.model.name, config.worker.role, config.server.host,
             config.server.port)
    run_uvicorn(app, config)
