"""The router in front of other engines' workers: `pdserve router --worker vllm=http://HOST:PORT` (or
`sglang=`), so a team can put pdserve's routing in front of the fleet it already runs.

There is no PD pairing here: each worker serves whole requests, and a request goes to one worker
as it came (the OpenAI API, streaming included, the body untouched), its answer streamed back as
the worker writes it. What the router adds is the choice of worker:

- load, from each worker's `/metrics` (vLLM: `vllm:num_requests_running`, `..._waiting`,
  `vllm:kv_cache_usage_perc`; SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
  `sglang:token_usage`), scraped every health period, with the router's own count of what it has
  in flight there;
- the cache, from each worker's KV events in vLLM's format (a ZMQ SUB to its publisher, its replay
  socket for what was missed). vLLM's block hashes are not pdserve's, and the router need not know
  vLLM's hash function: a BlockStored event carries its blocks' token ids and the parent block's
  hash, so the router rebuilds each block's prefix chain with its own hash of the token ids
  (cache/kv_events_vllm.py, `rehash`) and matches a prompt's blocks, tokenized here, at the
  worker's block size, against that.

The routing policy is `load_balancer.decode` (routing.md), over the same policy functions as
pdserve's own workers. A worker restart (its `process_start_time_seconds` changes) drops its blocks
until its events say what it holds again. Retries before any byte of the answer: connect errors,
5xx and 429 go to another worker, with each worker's circuit breaker hearing its verdicts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cache.prefix_cache import prompt_hashes
from pdserve.config import Config
from pdserve.config_rules import ENGINES
from pdserve.router import policies
from pdserve.router.access import Access, KeyStore, bearer_key, check_admin_exposure, exposure_warnings
from pdserve.router.kv_index_feed import IndexFeed
from pdserve.router.registry import Breaker
from pdserve.router.security import Allowlist, SecurityMiddleware
from pdserve.router.shared_limits import rate_limiter
from pdserve.router.tokenizer_pool import TokenizerPool
from pdserve.server.body_limit import install_body_limit
from pdserve.server.errors import error_response
from pdserve.server.internal_api import internal_token

log = logging.getLogger(__name__)

# Load gauges by engine: (running, waiting, KV usage 0..1); the first name found of each tuple counts.
GAUGES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (
        ("vllm:num_requests_running",),
        ("vllm:num_requests_waiting",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": (("sglang:num_running_reqs",), ("sglang:num_queue_reqs",), ("sglang:token_usage",)),
}
WORKER_HEADER = "x-pdserve-worker"  # on every answer: the worker that served it
_FORWARDED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
_KEPT_HEADERS = ("content-type", "cache-control", "x-request-id")
_HEALTH_TIMEOUT_S = 2.0


def fronts_engines(config: Config) -> bool:
    return any(w.get("role") in ENGINES for w in config.router.workers)


def scrape(text: str, engine: str) -> dict[str, float]:
    """running, waiting, kv_usage (summed over label sets; absent names: not in the dict) and
    start (process_start_time_seconds: a new value is a restart) from a Prometheus text page."""
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    out = {}
    for key, names in zip(("running", "waiting", "kv_usage"), GAUGES[engine]):
        found = next((n for n in names if n in sums), None)
        if found is not None:
            out[key] = sums[found]
    if "process_start_time_seconds" in sums:
        out["start"] = sums["process_start_time_seconds"]
    return out


@dataclass
class EngineWorker:
    worker_id: str  # also the name the KV index knows it by
    engine: str
    url: str
    breaker: Breaker
    events: str | None = None  # its KV event publisher (vLLM's --kv-events-config endpoint)
    replay: str | None = None  # its replay socket
    healthy: bool = False
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    start: float | None = None
    in_flight: int = 0  # the router's own count
    queued_prefill_tokens: int = 0  # uncached prompt tokens sent there and not answered yet (estimate)
    decode_tokens: int = 0  # max_tokens of the requests in flight there (estimate)
    requests: int = 0
    errors: int = 0

    def state(self, now: float, capacity: int) -> policies.WorkerState:
        return policies.WorkerState(
            self.worker_id,
            "mixed",
            healthy=self.healthy,
            breaker_open=not self.breaker.allows(now),
            # Its own gauges count other routers' and clients' requests too.
            in_flight=max(self.in_flight, int(self.running + self.waiting)),
            queued_prefill_tokens=self.queued_prefill_tokens,
            decode_tokens=self.decode_tokens,
            kv_usage=self.kv_usage,
            capacity=capacity,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.worker_id,
            "engine": self.engine,
            "url": self.url,
            "healthy": self.healthy,
            "breaker": self.breaker.state.value,
            "kv_events_endpoint": self.events,
            "kv_events_replay_endpoint": self.replay,
            "load": {
                "in_flight": self.in_flight,
                "running": self.running,
                "waiting": self.waiting,
                "kv_usage": self.kv_usage,
            },
            "requests": self.requests,
            "errors": self.errors,
        }


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_front_requests",
            "Requests sent to fronted workers, by worker and by why it was chosen",
            ["worker", "decision"],
            registry=self.registry,
        )
        self.failures = Counter(
            "pdserve_front_failures",
            "Attempts on a fronted worker that failed before any byte (connect error, 5xx, 429)",
            ["worker"],
            registry=self.registry,
        )
        self.prompt_blocks = Counter(
            "pdserve_front_prompt_blocks",
            "Full blocks of the prompts routed (at the chosen worker's block size)",
            registry=self.registry,
        )
        self.cached_blocks = Counter(
            "pdserve_front_cached_blocks",
            "Leading prompt blocks the KV index says the chosen worker held",
            registry=self.registry,
        )
        self.index_blocks = Gauge(
            "pdserve_front_index_blocks",
            "Blocks the KV index holds per fronted worker",
            ["worker"],
            registry=self.registry,
        )


def _chat_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


class Front:
    def __init__(self, config: Config) -> None:
        rc = config.router
        self.config, self.rc = config, rc
        self.workers: dict[str, EngineWorker] = {}
        for i, spec in enumerate(rc.workers, 1):
            engine = spec["role"]
            w = EngineWorker(
                f"{engine}-{i}",
                engine,
                spec["url"].rstrip("/"),
                Breaker(rc.breaker_failures, rc.breaker_cooldown_s),
                spec.get("kv_events_endpoint"),
                spec.get("kv_events_replay_endpoint"),
            )
            self.workers[w.worker_id] = w
        self.feed = IndexFeed(rehash=True)
        self.tokenizers = TokenizerPool(config.model.name, rc.encoder_workers)
        self.metrics = FrontMetrics()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(rc.request_timeout_s, connect=rc.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        key = rc.upstream_api_key or os.environ.get("PDSERVE_UPSTREAM_API_KEY")
        self.upstream_headers = {"authorization": f"Bearer {key}"} if key else {}
        self.counter = 0
        self.rng = random.Random(0)

    # ------------------------------------------------------------------ health, load and events

    async def check(self, w: EngineWorker) -> None:
        try:
            r = await self.client.get(
                w.url + "/health", timeout=_HEALTH_TIMEOUT_S, headers=self.upstream_headers
            )
            ok = r.status_code == 200
            if ok and w.events is None:
                self._discover(w, r)
            if ok:
                m = await self.client.get(
                    w.url + "/metrics", timeout=_HEALTH_TIMEOUT_S, headers=self.upstream_headers
                )
                if m.status_code == 200:
                    got = scrape(m.text, w.engine)
                    w.running, w.waiting = got.get("running", 0.0), got.get("waiting", 0.0)
                    w.kv_usage = got.get("kv_usage", 0.0)
                    w.start = got.get("start", w.start)
        except (httpx.HTTPError, ValueError) as e:
            log.debug("%s: %s", w.url, e)
            ok = False
        if ok != w.healthy:
            state = "healthy" if ok else "unhealthy"
            log.log(
                logging.INFO if ok else logging.WARNING, "worker %s (%s) is %s", w.worker_id, w.url, state
            )
            if ok:
                w.breaker.on_success()
        w.healthy = ok
        if ok and w.events:
            # A new start time: the worker restarted and holds none of the blocks indexed for it.
            self.feed.watch(w.events, w.replay, w.worker_id, w.start, "vllm")

    @staticmethod
    def _discover(w: EngineWorker, r: httpx.Response) -> None:
        """A pdserve worker publishing vLLM's format names its sockets in /health; vLLM does not (they
        come from the worker's spec)."""
        try:
            h = r.json()
        except ValueError:
            return
        if isinstance(h, dict) and h.get("kv_events_format") in ("vllm", "vllm-array"):
            w.events, w.replay = h.get("kv_events_endpoint"), h.get("kv_events_replay_endpoint")

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in self.workers.values()))
            for w in self.workers.values():
                self.metrics.index_blocks.labels(w.worker_id).set(self.feed.blocks_of(w.worker_id))
            await asyncio.sleep(self.rc.health_period_s)

    # ------------------------------------------------------------------ routing

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the workers will see them, for matching their cached blocks;
        [] when they cannot be known here (the request then goes by load alone)."""
        try:
            if path == "/v1/chat/completions":
                msgs = body.get("messages")
                if not isinstance(msgs, list):
                    return []
                messages = [
                    {"role": str(m.get("role", "user")), "content": _chat_text(m.get("content"))}
                    for m in msgs
                    if isinstance(m, dict)
                ]
                kwargs = body.get("chat_template_kwargs")
                return await self.tokenizers.encode_chat(
                    messages, True, False, kwargs if isinstance(kwargs, dict) else None
                )
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: route by the first
            if isinstance(prompt, str):
                return await self.tokenizers.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception as e:  # noqa: BLE001 - a template or tokenizer error must not fail the request
            log.debug("routing without the cache: %s", e)
        return []

    def cache_hits(self, tokens: list[int]) -> tuple[dict[str, tuple[int, str]], int]:
        """worker -> (leading blocks it holds, tier), and the block size used (the most common one)."""
        sizes = self.feed.block_sizes()
        if not tokens or not sizes:
            return {}, 16
        hits: dict[str, tuple[int, str]] = {}
        for bs in set(sizes.values()):
            hashes = prompt_hashes(tokens, bs)
            with self.feed.lock:
                found = self.feed.index.match(hashes)
            hits.update({name: hit for name, hit in found.items() if sizes.get(name) == bs})
        values = list(sizes.values())
        return hits, max(set(values), key=values.count)

    def pick(
        self, tokens: list[int], max_tokens: int, exclude: set[str]
    ) -> tuple[EngineWorker | None, policies.Decision, int, int]:
        """(worker or None, the decision, leading blocks it holds, the block size matched at)"""
        hits, bs = self.cache_hits(tokens)
        now = time.monotonic()
        states = [
            w.state(now, self.rc.max_concurrent) for w in self.workers.values() if w.worker_id not in exclude
        ]
        req = policies.RouteRequest(len(tokens), max_tokens, bs, hits)
        self.counter += 1
        d = policies.choose(self.config.load_balancer.decode, req, states, counter=self.counter, rng=self.rng)
        w = self.workers.get(d.worker_id) if d.worker_id else None
        cached = hits.get(w.worker_id, (0, ""))[0] if w else 0
        return w, d, cached, bs

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return error_response(400, "the body is not JSON", code="invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", code="invalid_json")
        tokens = await self.prompt_tokens(path, body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 16
        headers = {"content-type": "application/json", **self.upstream_headers}
        for h in ("x-request-id", "traceparent"):
            if h in request.headers:
                headers[h] = request.headers[h]
        tried: set[str] = set()
        last = "no worker is up"
        for attempt in range(self.rc.max_retries + 1):
            w, d, cached, bs = self.pick(tokens, max_tokens, tried)
            if w is None:
                if d.reason == "overloaded":
                    return error_response(
                        429, "every worker is busy", code="overloaded", headers={"Retry-After": "1"}
                    )
                break
            tried.add(w.worker_id)
            w.breaker.on_attempt()
            uncached = max(0, len(tokens) - cached * bs)
            try:
                resp = await self.client.send(
                    self.client.build_request("POST", w.url + path, content=raw, headers=headers), stream=True
                )
            except httpx.HTTPError as e:
                last = f"{w.worker_id}: {type(e).__name__}"
                self._failed(w)
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                last = f"{w.worker_id}: HTTP {resp.status_code}"
                await resp.aclose()
                self._failed(w)
                if attempt < self.rc.max_retries:
                    await asyncio.sleep(self.rc.retry_backoff_s * (2**attempt) * (0.5 + self.rng.random()))
                continue
            self.metrics.requests.labels(w.worker_id, d.reason).inc()
            self.metrics.prompt_blocks.inc(len(tokens) // bs)
            self.metrics.cached_blocks.inc(cached)
            return self._relay(w, resp, uncached, max_tokens)
        return error_response(503, f"no worker could take the request ({last})", code="no_workers")

    def _failed(self, w: EngineWorker) -> None:
        w.errors += 1
        w.breaker.on_failure(time.monotonic())
        self.metrics.failures.labels(w.worker_id).inc()

    def _relay(self, w: EngineWorker, resp: httpx.Response, uncached: int, max_tokens: int) -> Response:
        w.in_flight += 1
        w.requests += 1
        w.queued_prefill_tokens += uncached
        w.decode_tokens += max_tokens
        state = {"prefill": uncached}

        async def body() -> AsyncIterator[bytes]:
            ok = False
            try:
                async for chunk in resp.aiter_bytes():  # decoded: the client gets no content-encoding
                    if state["prefill"]:  # the first bytes: the prompt is computed
                        w.queued_prefill_tokens -= state["prefill"]
                        state["prefill"] = 0
                    yield chunk
                ok = True
            finally:
                await resp.aclose()
                w.in_flight -= 1
                w.queued_prefill_tokens -= state["prefill"]
                w.decode_tokens -= max_tokens
                if ok:
                    w.breaker.on_success()
                else:
                    w.breaker.on_abandon()

        kept = {k: v for k, v in resp.headers.items() if k.lower() in _KEPT_HEADERS}
        kept[WORKER_HEADER] = w.worker_id
        return StreamingResponse(body(), status_code=resp.status_code, headers=kept)


def create_front_app(config: Config) -> FastAPI:
    """The router's app when it fronts vLLM or SGLang workers (router.workers with role vllm|sglang)."""
    rc = config.router
    check_admin_exposure(config)
    front = Front(config)
    token = internal_token(config.server.internal_token)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(front.health_loop())
        await front.tokenizers.warm_up()
        yield
        task.cancel()
        await front.client.aclose()
        front.feed.close()
        front.tokenizers.close()

    app = FastAPI(title="pdserve router (fronting other engines)", version="0.1.0", lifespan=lifespan)
    app.state.front = front
    install_body_limit(app, config.server.max_body_bytes)
    access = Access(KeyStore(rc.api_keys), KeyStore(rc.admin_keys, "PDSERVE_ADMIN_KEYS", "admin-"), token)
    for line in exposure_warnings(
        config.server.host, access.clients.enabled, access.admins.enabled, bool(token), static_workers=True
    ):
        log.warning(line)
    limiter = rate_limiter(rc.requests_per_minute, None, rc.shared_limits)
    app.add_middleware(
        SecurityMiddleware, access=access, allowlist=Allowlist(rc.ip_allowlist), limiter=limiter
    )

    for path in _FORWARDED:

        async def route(request: Request, path: str = path) -> Response:
            return await front.forward(request, path)

        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/models")
    async def models():
        for w in front.workers.values():
            if w.healthy:
                try:
                    r = await front.client.get(
                        w.url + "/v1/models", headers=front.upstream_headers, timeout=_HEALTH_TIMEOUT_S
                    )
                except httpx.HTTPError:
                    continue
                if r.status_code == 200:
                    return Response(r.content, media_type="application/json")
        return error_response(503, "no healthy worker", code="no_workers")

    @app.get("/health")
    async def health(request: Request):
        if not any(w.healthy for w in front.workers.values()):
            return error_response(503, "no healthy worker", code="no_workers")
        if not access.admin_allowed(bearer_key(request.headers.get("authorization", ""))):
            return {"status": "ok"}
        return {"status": "ok", "workers": [w.describe() for w in front.workers.values()]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(front.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/admin/workers")
    async def list_workers():
        sizes = front.feed.block_sizes()
        out = []
        for w in front.workers.values():
            d = w.describe()
            d["kv_index_blocks"] = front.feed.blocks_of(w.worker_id)
            d["block_size"] = sizes.get(w.worker_id)
            out.append(d)
        return {"workers": out}

    return app
