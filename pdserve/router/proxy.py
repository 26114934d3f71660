"""A minimal PD router: pairs each request with a decode worker and a prefill worker and relays it.

The decode worker serves the OpenAI API itself (tokenization, detokenization); the router picks
the least-loaded healthy decode worker, names a prefill worker in the `x-pdserve-prefill` header
(round robin over healthy ones), and streams the answer back unchanged. A decode worker that
refuses the connection is retried on the next one; nothing is retried once bytes have flowed.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.server.errors import error_response
from pdserve.server.openai_api import PREFILL_HEADER

log = logging.getLogger(__name__)
_HEALTH_PERIOD_S = 1.0
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host"}


@dataclass
class Worker:
    url: str
    role: str
    healthy: bool = False
    pid: int | None = None
    kv_endpoint: str | None = None
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    last_health: dict = field(default_factory=dict)


class Pool:
    def __init__(self, decode_urls: list[str], prefill_urls: list[str]) -> None:
        self.decode = [Worker(u.rstrip("/"), "decode") for u in decode_urls]
        self.prefill = [Worker(u.rstrip("/"), "prefill") for u in prefill_urls]
        self._rr = itertools.count()

    @property
    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def decode_order(self) -> list[Worker]:
        """Healthy decode workers, least in flight first."""
        return sorted((w for w in self.decode if w.healthy), key=lambda w: w.in_flight)

    def pick_prefill(self) -> Worker | None:
        healthy = [w for w in self.prefill if w.healthy and w.kv_endpoint]
        return healthy[next(self._rr) % len(healthy)] if healthy else None


def create_router_app(decode_urls: list[str], prefill_urls: list[str], timeout_s: float = 600.0) -> FastAPI:
    pool = Pool(decode_urls, prefill_urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def check(w: Worker) -> None:
        try:
            r = await client.get(w.url + "/health", timeout=2.0)
            w.healthy = r.status_code == 200
            if w.healthy:
                w.last_health = r.json()
                w.pid = w.last_health.get("pid")
                w.kv_endpoint = w.last_health.get("kv_endpoint")
        except httpx.HTTPError:
            w.healthy = False

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(w) for w in pool.all))
            await asyncio.sleep(_HEALTH_PERIOD_S)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await asyncio.gather(*(check(w) for w in pool.all))
        task = asyncio.create_task(health_loop())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.pool = pool

    @app.get("/health")
    async def health():
        if not pool.decode_order():
            return error_response(503, "no healthy decode worker", code="no_workers")
        return {"status": "ok", "workers": [
            {"url": w.url, "role": w.role, "healthy": w.healthy, "pid": w.pid, "in_flight": w.in_flight,
             "kv_endpoint": w.kv_endpoint} for w in pool.all]}

    @app.get("/v1/models")
    async def models():
        for w in pool.decode_order():
            try:
                r = await client.get(w.url + "/v1/models")
                return JSONResponse(r.json(), status_code=r.status_code)
            except httpx.HTTPError:
                w.healthy = False
        return error_response(503, "no healthy decode worker", code="no_workers")

    async def relay(request: Request, path: str) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        prefill = pool.pick_prefill()
        if prefill is not None:
            headers[PREFILL_HEADER] = prefill.kv_endpoint
        for w in pool.decode_order():
            req = client.build_request("POST", w.url + path, content=body, headers=headers)
            try:
                resp = await client.send(req, stream=True)
            except httpx.ConnectError as e:     # nothing was sent: safe to try the next worker
                log.warning("decode worker %s refused: %s", w.url, e)
                w.healthy, w.errors = False, w.errors + 1
                continue
            w.in_flight += 1
            w.requests += 1
            started = time.monotonic()

            async def body_iter(resp=resp, w=w):
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                except httpx.HTTPError as e:
                    log.warning("decode worker %s failed mid-response after %.1fs: %s", w.url,
                                time.monotonic() - started, e)
                    w.errors += 1
                finally:
                    w.in_flight -= 1
                    await resp.aclose()

            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
            return StreamingResponse(body_iter(), status_code=resp.status_code, headers=out_headers)
        return error_response(503, "no healthy decode worker", code="no_workers", headers={"Retry-After": "1"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay(request, "/v1/chat/completions")

    return app
