"""The router's HTTP front: the OpenAI API over the workers, admin routes, health and metrics.

Requests are tokenized by the tokenizer pool, routed by the policies over the registry and the
global KV index, streamed from a decode worker as token ids, and detokenized here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request

from pdserve.common import tracing
from pdserve.common.images import image_slots
from pdserve.config import Config, served_names
from pdserve.control.controller import Controller, Fleet
from pdserve.control.host_fleet import HostsFleet, hosts_fleet
from pdserve.control.role_switch import SwitchRefused, switch_role
from pdserve.control.rollout_api import install_rollout_routes
from pdserve.protocol import (
    INTERNAL_TOKEN_HEADER,
    WorkerRegistration,
)
from pdserve.protocol.control import RoleChange
from pdserve.router.access import Access, KeyStore, bearer_key, check_admin_exposure, exposure_warnings
from pdserve.router.admission import Admission
from pdserve.router.backend import RemoteBackend
from pdserve.router.front import create_front_app, fronts_engines
from pdserve.router.kv_index_feed import IndexFeed
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Registry
from pdserve.router.security import Allowlist, SecurityMiddleware
from pdserve.router.shared_limits import rate_limiter
from pdserve.router.tokenizer_pool import TokenizerPool, load_tokenizer
from pdserve.server.errors import error_response
from pdserve.server.internal_api import internal_token
from pdserve.server.metrics import RequestTimer, ServerMetrics
from pdserve.server.openai_api import OpenAIHandlers, install_openai_api

log = logging.getLogger(__name__)
_SUMMED = (
    "running",
    "waiting",
    "kv_blocks_total",
    "kv_blocks_free",
    "prefix_cache_blocks",
    "prefill_tokens_computed",
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
)


def create_router_app(config: Config, fleet: Fleet | None = None) -> FastAPI:
    """`fleet`: how the controller starts and stops workers (pdserve serve passes its local one)."""
    if fronts_engines(config):  # vLLM or SGLang workers: forwarded as they are (router/front.py)
        return create_front_app(config)
    rc = config.router
    check_admin_exposure(config)
    tracing.setup("pdserve-router", config.server.otlp_endpoint)
    token = internal_token(config.server.internal_token)
    registry = Registry(
        rc.breaker_failures,
        rc.breaker_cooldown_s,
        rc.heartbeat_timeout_s,
        {INTERNAL_TOKEN_HEADER: token} if token else {},
    )
    for spec in rc.workers:
        registry.add_static(spec["url"], spec.get("role", "mixed"))
    model_names = served_names(config)
    model_name = model_names[0]

    def fleet_stats() -> dict[str, float]:
        """Engine gauges summed over healthy workers (the worker-level figures are on each worker)."""
        healthy = [w.health for w in registry.workers.values() if w.healthy and w.health]
        out = {k: sum(h.stat(k) for h in healthy) for k in _SUMMED}
        total = out["kv_blocks_total"]
        out["kv_usage"] = 1.0 - out["kv_blocks_free"] / total if total else 0.0
        return out

    server_metrics = ServerMetrics(fleet_stats)
    metrics = RouterMetrics(server_metrics.registry, registry)
    timer = RequestTimer(server_metrics)
    limiter = rate_limiter(rc.requests_per_minute, rc.tokens_per_minute, rc.shared_limits)
    tokenizer_pool = TokenizerPool(config.model.name, rc.encoder_workers)
    tokenizer = tokenizer_pool.local or load_tokenizer(config.model.name)  # for detokenizing the streams
    feed = IndexFeed(token)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(rc.request_timeout_s, connect=rc.connect_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
    )
    admission = Admission(rc.max_concurrent, rc.max_queue, rc.queue_timeout_s)
    backend = RemoteBackend(
        config,
        registry,
        tokenizer,
        client,
        metrics,
        feed,
        admission,
        lambda who, n: limiter.charge_tokens(who, n, time.monotonic()),
        timer.on_output,
    )
    if config.controller.enabled and fleet is None and config.controller.backend == "kubernetes":
        from pdserve.control.k8s_fleet import KubernetesFleet

        fleet = KubernetesFleet(config.controller)
    hosts: HostsFleet | None = None
    if fleet is None and config.controller.backend == "hosts":
        # Rollouts need it with the controller off as well.
        fleet = hosts = hosts_fleet(config)
    # Off, it still exports each pool's pressure (for an HPA); on, it acts.
    controller = Controller(
        config,
        registry,
        client,
        server_metrics.ttft,
        server_metrics.itl,
        fleet,
        server_metrics.registry,
        timer.oldest_wait,
        backend.held_prefill_tokens,
    )
    handlers = OpenAIHandlers(
        backend, tokenizer, model_name, timer, encoder=tokenizer_pool, aliases=model_names
    )
    handlers.vision, handlers.vision_limits = image_slots(config.model.name), config.vision  # None: text only
    handlers.reasoning = config.server.reasoning_parser
    handlers.tool_call_parser = config.server.tool_call_parser

    async def health_loop() -> None:
        while True:
            await registry.check_all(client)
            for w in registry.workers.values():
                if w.healthy and (h := w.health) is not None:
                    # A new pid or snapshot port: the worker restarted, its indexed blocks are gone.
                    vllm = h.kv_events_format != "pdserve"  # vLLM's format: a replay socket, no snapshots
                    snap = h.kv_events_replay_endpoint if vllm else h.kv_events_snapshot_endpoint
                    feed.watch(h.kv_events_endpoint, snap, h.worker_id, (h.pid, snap), h.kv_events_format)
                    # The context is the decode side's: a prefill worker's may be longer or shorter.
                    if w.role != "prefill" and not backend.max_model_len and h.max_model_len:
                        backend.max_model_len = h.max_model_len
            # Workers that left the registry: their subscribers close (one per worker ever seen otherwise).
            feed.retain(
                {
                    w.health.kv_events_endpoint
                    for w in registry.workers.values()
                    if w.health is not None and w.health.kv_events_endpoint
                }
            )
            await asyncio.sleep(rc.health_period_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(health_loop())
        control = asyncio.create_task(controller.run())
        await tokenizer_pool.warm_up()
        yield
        backend.accepting = False
        task.cancel()
        control.cancel()
        await asyncio.wait([control], timeout=2.0)  # it hands its controller lease on
        await client.aclose()
        if hosts is not None:
            await hosts.aclose()
        feed.close()
        tokenizer_pool.close()

    app = FastAPI(title="pdserve router", version="0.1.0", lifespan=lifespan)
    app.state.registry = registry
    install_openai_api(
        app, handlers, server_metrics, lambda: backend.max_model_len, config.server.max_body_bytes
    )
    access = Access(KeyStore(rc.api_keys), KeyStore(rc.admin_keys, "PDSERVE_ADMIN_KEYS", "admin-"), token)
    for line in exposure_warnings(
        config.server.host,
        access.clients.enabled,
        access.admins.enabled,
        bool(token),
        static_workers=bool(rc.workers),
    ):
        log.warning(line)
    app.add_middleware(
        SecurityMiddleware,
        access=access,
        allowlist=Allowlist(rc.ip_allowlist),
        limiter=limiter,
        on_reject=lambda status: metrics.rejected.labels(str(status)).inc(),
    )

    @app.get("/health")
    async def health(request: Request):
        decode = [w for w in registry.pool("decode") if w.healthy and not w.draining]
        if not decode:
            return error_response(503, "no healthy decode worker", code="no_workers")
        if not access.admin_allowed(bearer_key(request.headers.get("authorization", ""))):
            return {"status": "ok"}  # probes; the workers' URLs, pids and KV endpoints are the admin API's
        return {"status": "ok", "workers": [w.describe() for w in registry.workers.values()]}

    # ------------------------------------------------------------------ admin (who may call: access.py)

    @app.get("/admin/workers")
    async def list_workers():
        out = []
        for w in registry.workers.values():
            d = w.describe()
            d["kv_index_blocks"] = feed.blocks_of(w.health.worker_id if w.health else None)
            out.append(d)
        return {"workers": out}

    @app.post("/admin/workers/register")
    async def register(reg: WorkerRegistration):
        w = registry.register(reg, time.monotonic())
        await registry.check(client, w, time.monotonic())
        return w.describe()

    @app.post("/admin/workers/{worker_id}/heartbeat")
    async def heartbeat(worker_id: str):
        if not registry.heartbeat(worker_id, time.monotonic()):
            return error_response(404, f"no worker {worker_id!r}; register first", code="unknown_worker")
        return {"ok": True}

    @app.post("/admin/workers/{worker_id}/drain")
    async def drain(worker_id: str):
        w = registry.workers.get(worker_id)
        if w is None:
            return error_response(404, f"no worker {worker_id!r}", code="unknown_worker")
        w.draining = True
        log.info("worker %s draining (%d in flight)", worker_id, w.in_flight)
        return w.describe()

    @app.post("/admin/workers/{worker_id}/role")
    async def set_role(worker_id: str, change: RoleChange):
        w = registry.workers.get(worker_id)
        if w is None:
            return error_response(404, f"no worker {worker_id!r}", code="unknown_worker")
        drain_s = (
            change.drain_timeout_s
            if change.drain_timeout_s is not None
            else config.controller.drain_timeout_s
        )
        try:
            await switch_role(registry, client, w, change.role, drain_s)
        except SwitchRefused as e:
            return error_response(e.status, str(e), "role", e.code)
        return w.describe()

    install_rollout_routes(app, config, registry, client, backend, fleet)  # canary, start, retire

    @app.get("/admin/controller")
    async def controller_decisions():
        """The controller's decisions, newest last (empty when controller.enabled is false)."""
        return controller.describe()

    @app.delete("/admin/workers/{worker_id}")
    async def deregister(worker_id: str):
        w = registry.workers.get(worker_id)
        if w is None:
            return error_response(404, f"no worker {worker_id!r}", code="unknown_worker")
        if w.in_flight:
            return error_response(
                409,
                f"worker {worker_id!r} has {w.in_flight} requests in flight; drain it first",
                code="worker_busy",
            )
        registry.deregister(worker_id)
        return {"deleted": worker_id}

    return app
