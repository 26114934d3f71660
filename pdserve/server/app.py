"""The serving process of the mixed role: one engine behind the OpenAI-compatible API."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pdserve import __version__
from pdserve.common import tracing
from pdserve.config import Config, served_names
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.health import WorkerHealth
from pdserve.server.errors import error_response
from pdserve.server.internal_api import (
    RequireInternalToken,
    install_internal_routes,
    internal_token,
    worker_api_keys,
)
from pdserve.server.metrics import RequestTimer, ServerMetrics
from pdserve.server.openai_api import OpenAIHandlers, install_openai_api
from pdserve.server.prefiller import PrefillerResolver
from pdserve.server.registration import register_with_routers
from pdserve.server.role_switch import RoleSwitch, install_role_route
from pdserve.server.roles import build_engine, worker_name
from pdserve.server.serving import bind_socket, run_uvicorn  # noqa: F401 (bind_socket re-exported)
from pdserve.utils import core_share
from pdserve.version import config_digest

log = logging.getLogger(__name__)


def create_app(config: Config, engine: LLMEngine | None = None, digest: str | None = None) -> FastAPI:
    """`digest`: the version's config digest, of the deployment config before the role's settings
    (cli.py; pdserve/version.py); None: of `config`."""
    tracing.setup(f"pdserve-{config.worker.role}", config.server.otlp_endpoint)
    engine = engine or build_engine(config)
    if os.environ.get(core_share.ENV) and config.server.threads and config.model.expert_parallel <= 1:
        # A one-machine deployment's launcher gave its workers a directory to lend idle cores through.
        # Not for expert-parallel ranks: each rank's replicated attention must compute the same bits
        # as the others', which run on their own threads (model/expert_parallel.py).
        engine.core_share = core_share.CoreShare(os.environ[core_share.ENV], config.server.threads)
    model_names = served_names(config)
    model_name = model_names[0]
    vllm_names = (model_name, engine.max_model_len) if config.server.vllm_metrics else None
    metrics = ServerMetrics(engine.stats, vllm_names)
    timer = RequestTimer(metrics)
    async_engine = AsyncEngine(engine, on_output=timer.on_output)
    handlers = OpenAIHandlers(async_engine, engine.tokenizer, model_name, timer, aliases=model_names)
    handlers.reasoning = config.server.reasoning_parser
    handlers.tool_call_parser = config.server.tool_call_parser
    handlers.prefill_resolver = PrefillerResolver()  # only a decode worker's connector acts on a peer
    if engine.images is not None:  # a vision-language model reads image_url parts
        handlers.vision, handlers.vision_limits = engine.images.slots, config.vision
    switch = RoleSwitch(config, async_engine)
    digest = digest or config_digest(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        registration = (
            asyncio.create_task(
                register_with_routers(config, model_name, lambda: switch.role, switch.changed, digest)
            )
            if config.server.router_url
            else None
        )
        yield
        if registration is not None:
            registration.cancel()
        await handlers.prefill_resolver.close()
        # uvicorn has already let open connections finish (or cancelled them at its timeout).
        async_engine.shutdown(timeout=config.server.shutdown_timeout_s)
        engine.connector.close()
        engine.close()

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    app.state.engine = async_engine
    install_openai_api(app, handlers, metrics, lambda: engine.max_model_len, config.server.max_body_bytes)
    token = internal_token(config.server.internal_token)
    if token:  # outside routers' keys reach the OpenAI API only (server.worker_api_keys)
        app.add_middleware(
            RequireInternalToken, token=token, keys=worker_api_keys(config.server.worker_api_keys)
        )
    install_internal_routes(app, async_engine, timer, switch.refusal)
    install_role_route(app, switch)

    @app.get("/health")
    async def health():
        if async_engine.dead is not None:
            return error_response(503, f"engine failed: {async_engine.dead}", code="engine_dead")
        if not async_engine.accepting:
            return error_response(503, "shutting down", code="shutting_down")
        return WorkerHealth(
            role=switch.role,
            pid=os.getpid(),
            worker_id=worker_name(config),
            model=model_name,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=engine.max_model_len,
            kv_endpoint=getattr(engine.connector, "endpoint", None),
            pdserve_version=__version__,
            config_digest=digest,
            **engine.stats(),
        ).to_wire()

    # MoE models: the expert-load heatmap and placement (EPLB), and the balancer's gauges in /metrics.
    eplb = getattr(engine.model, "eplb", None)
    traffic = getattr(engine.model, "traffic", None)  # expert parallelism's bytes between ranks
    if eplb is not None:
        eplb.register_metrics(metrics.registry)
    if traffic is not None and traffic():
        from pdserve.eplb.metrics import EPTrafficCollector

        metrics.registry.register(EPTrafficCollector(traffic))

    @app.get("/eplb")
    async def eplb_heatmap():
        if eplb is None:
            return error_response(404, "the model has no MoE layers", code="not_moe")
        return {**eplb.to_dict(), **({"traffic": traffic()} if traffic is not None and traffic() else {})}

    return app


def serve(config: Config, sock=None, digest: str | None = None) -> None:
    app = create_app(config, digest=digest)
    log.info(
        "serving %s (%s) on http://%s:%d",
        config.model.name,
        config.worker.role,
        config.server.host,
        config.server.port,
    )
    run_uvicorn(app, config, sock=sock)
