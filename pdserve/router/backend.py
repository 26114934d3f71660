"""The router's generation backend: pick workers, stream token ids from a decode worker, detokenize.

Same interface as the worker's AsyncEngine (`generate`, `check_request`, `accepting`), so the
OpenAI handlers run unchanged on top. Per request:
- the policies (router/policies.py) pick a decode worker and then, as its pair, a prefill worker
  from the registry's states and the global KV index; the request is counted on both
  (router/accounting.py), and the decode worker's first line says which prefill worker filled the
  prompt and which failed to, so each one's circuit breaker hears its own verdict;
- before any token, connect errors, 5xx and 429 are retried with exponential backoff and jitter
  on another worker;
- once tokens have streamed, a dying decode worker is not retried but *migrated*: the prompt plus
  the tokens generated so far go to another decode worker (through a prefill) and the same
  stream continues; greedy output equals a fault-free run's.
Stop strings are matched here, on the text; workers see only token-level stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace

import httpx

from pdserve.cache.prefix_cache import prompt_hashes, salt_key
from pdserve.common import tracing
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.errors import InvalidParam
from pdserve.common.images import ImageInput
from pdserve.common.outputs import RequestOutput, TokenLogprob
from pdserve.common.sampling import SamplingParams, check_prompt
from pdserve.common.tokenizer import TokenizerWrapper
from pdserve.config import Config, for_role
from pdserve.protocol.health import WorkerHealth
from pdserve.protocol.stream import TokenLine
from pdserve.router import policies
from pdserve.router.accounting import Charge, Route, remote_prefill_tokens
from pdserve.router.admission import Admission
from pdserve.router.kv_index_feed import IndexFeed
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefill_hold import PrefillHold
from pdserve.router.registry import Registry, Worker
from pdserve.router.security import arrived_at, current_key
from pdserve.router.stream_watch import WorkerSilent, unless_silent, watched
from pdserve.server.errors import APIError
from pdserve.server.openai_api import PREFILL_HEADER

StreamDelta = tuple[list[int], list[TokenLogprob] | None, bool, str | None, list[TokenLogprob | None] | None]
log = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """The worker failed this request in a way another worker may not (retry or migrate)."""


class WorkerMoved(WorkerFailed):
    """The worker gave the request up on purpose (draining to switch role or to leave): continue it
    elsewhere at once, without backoff, a retry or a mark against the worker's breaker."""


class RemoteBackend:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        tokenizer: TokenizerWrapper,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        index: IndexFeed,
        admission: Admission,
        charge_tokens: Callable,
        on_output: Callable[[RequestOutput, float], None] | None = None,
    ) -> None:
        self.config, self.rc = config, config.router
        self.registry, self.tokenizer, self.client = registry, tokenizer, client
        self.metrics, self.index, self.admission = metrics, index, admission
        self.charge_tokens = charge_tokens
        self.on_output = on_output or (lambda out, t: None)
        self.accepting = True
        self.max_model_len = config.model.max_model_len or 0  # learnt from the workers when unset
        self._rr = {"prefill": 0, "decode": 0}
        self._rng = random.Random(0)
        self.canary: policies.Canary | None = (
            None  # during a rollout (PUT /admin/canary, control/rollout_api.py)
        )
        self.hold = (
            PrefillHold(for_role(config, "prefill").scheduler.max_num_batched_tokens, self.rc.queue_timeout_s)
            if self.rc.hold_prefill
            else None
        )

    def held_prefill_tokens(self) -> int:
        return self.hold.held_tokens if self.hold else 0

    def set_canary(self, version: str, weight: float) -> None:
        """This share (0..1) of new requests goes to workers of `version` first (PUT /admin/canary)."""
        self.canary = policies.Canary(version, weight)

    # ------------------------------------------------------------------ validation (before any work)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if self.rc.max_prompt_tokens and n > self.rc.max_prompt_tokens:
            raise InvalidParam(
                f"the prompt has {n} tokens; this deployment accepts at most {self.rc.max_prompt_tokens}",
                "messages",
            )
        check_prompt(prompt_token_ids, params, self.tokenizer.vocab_size, self.max_model_len)

    # ------------------------------------------------------------------ routing

    def _states(self, role: str, exclude: set[str], now: float) -> list[policies.WorkerState]:
        out = []
        for w in self.registry.pool(role):
            if w.worker_id in exclude:
                continue
            h = w.health or WorkerHealth()
            out.append(
                policies.WorkerState(
                    worker_id=w.worker_id,
                    role=w.role,
                    healthy=w.healthy,
                    draining=w.draining,
                    breaker_open=not w.breaker.allows(now),
                    in_flight=w.in_flight,
                    queued_prefill_tokens=w.queued_prefill_tokens,
                    decode_tokens=w.decode_tokens,
                    kv_usage=h.kv_usage,
                    kv_free_blocks=h.kv_blocks_free,
                    kv_total_blocks=h.kv_blocks_total,
                    capacity=w.capacity,
                    version=w.version,
                )
            )
        return out

    def route(
        self,
        context: list[int],
        max_tokens: int,
        salt: str | bytes | None,
        exclude: set[str],
        images: Sequence[ImageInput] = (),
    ) -> tuple[Route | None, str]:
        """The decode worker, then the prefill worker it will ask (None: no prefill pool), and the
        prompt tokens that prefill worker is expected to compute: 0 when the decode worker's cache
        leaves too little to be worth a transfer (it prefills the rest itself)."""
        t0 = time.perf_counter()
        now = time.monotonic()
        bs = self.config.cache.block_size
        hits = self.index.match(prompt_hashes(context, bs, salt, images), self.registry) if self.index else {}
        draw = self._rng.random() if self.canary else 0.0  # one draw: a canary request is one on both pools
        try:
            decode, reason = self._pick("decode", len(context), max_tokens, hits, exclude, now, draw)
            if decode is None:
                return None, reason
            prefill, remote = None, 0
            if self.registry.pool("prefill"):
                prefill, _ = self._pick(
                    "prefill", len(context), 1, hits, exclude | {decode.worker_id}, now, draw
                )
                if prefill is not None and prefill.kv_endpoint:
                    remote = remote_prefill_tokens(
                        len(context),
                        hits.get(decode.worker_id),
                        bs,
                        self.config.disagg.local_prefill_max_tokens,
                    )
            return Route(decode, prefill, remote), reason
        finally:
            self.metrics.decision_seconds.observe(time.perf_counter() - t0)

    def _pick(
        self, role: str, n: int, max_tokens: int, hits: dict, exclude: set[str], now: float, draw: float = 0.0
    ) -> tuple[Worker | None, str]:
        req = policies.RouteRequest(
            num_prompt_tokens=n,
            max_tokens=max_tokens,
            block_size=self.config.cache.block_size,
            cache_hits=hits,
        )
        name = getattr(self.config.load_balancer, role)
        states = policies.canary_pool(self._states(role, exclude, now), self.canary, draw)
        d = policies.choose(name, req, states, counter=self._rr[role], rng=self._rng)
        self._rr[role] += 1
        self.metrics.decisions.labels(role, d.reason).inc()
        return (self.registry.workers.get(d.worker_id) if d.worker_id else None), d.reason

    def _prefill_peers(self, chosen: str, remote_tokens: int) -> list[str]:
        """The chosen prefill worker's KV endpoint; for a prompt long enough to be pipelined
        (disagg.parallel_prefill_min_tokens, disagg/parallel.py), the other healthy prefill workers'
        after it, least queued first: the decode worker cuts the prompt among them in this order."""
        n = self.config.disagg.parallel_prefill_min_tokens
        if not n or remote_tokens < n:
            return [chosen]
        others = sorted(
            (
                x
                for x in self.registry.pool("prefill")
                if x.role == "prefill" and x.healthy and x.kv_endpoint and x.kv_endpoint != chosen
            ),
            key=lambda x: x.queued_prefill_tokens,
        )
        return [chosen] + [x.kv_endpoint for x in others if x.kv_endpoint]

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prefill_peer: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes; closing the iterator aborts it upstream."""
        key = current_key.get()
        async with self.admission.slot():
            detok = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
            )
            # Text is made here: the worker sends token ids only and skips detokenizing them.
            wire = replace(params, stop=[], include_stop_str_in_output=False, detokenize=False)
            generated: list[int] = []
            attempts = migrations = moved = 0
            failed: set[str] = set()
            last_error: WorkerFailed | None = None  # told to the client when no worker is left
            migration_span = None  # tracing: from a stream's failure to its first token on the next worker
            salt = salt_key(cache_salt)  # digested once, not per block of every attempt's routing
            versions = self.metrics.versions.request()
            n_prompt = len(prompt_token_ids)
            try:
                while True:
                    remaining = None if params.max_tokens is None else params.max_tokens - len(generated)
                    context = prompt_token_ids + generated  # what the chosen worker will hold
                    with tracing.span("router.route", attempt=attempts):

                        def pick() -> tuple[Route | None, str]:
                            return self.route(context, remaining or 16, salt, failed, images)

                        route, reason = await self.hold.route(pick, len(context)) if self.hold else pick()
                    if route is None:
                        cause = f"; the last one failed it: {last_error}" if last_error else ""
                        raise APIError(
                            503,
                            f"no decode worker can take this request ({reason}){cause}",
                            code="no_workers",
                            headers={"Retry-After": "1"},
                        )
                    decode = route.decode
                    versions.attempt(route)
                    attempt_span = tracing.start(
                        "router.attempt",
                        worker=decode.worker_id,
                        attempt=attempts,
                        tokens_so_far=len(generated),
                    )
                    try:
                        # A migrated stream hands over what it generated as output, not as prompt: the
                        # new worker counts it for max_tokens, penalties and seeded draws.
                        stream = self._stream(
                            route,
                            f"{request_id}-{attempts}",
                            prompt_token_ids,
                            list(generated),
                            wire.__dict__,
                            cache_salt,
                            images,
                            trace=tracing.traceparent_of(attempt_span),
                        )
                        async with aclosing(stream):
                            async for tokens, lps, finished, finish_reason, plps in stream:
                                out_tokens: list[int] = []
                                stop_hit = False
                                for t in tokens:
                                    generated.append(t)
                                    out_tokens.append(t)
                                    if detok.add(t) is not None:
                                        stop_hit = True
                                        break
                                done = finished or stop_hit
                                out = RequestOutput(
                                    request_id,
                                    out_tokens,
                                    detok.take(done),
                                    done,
                                    "stop" if stop_hit else finish_reason,
                                    n_prompt,
                                    len(generated),
                                    (lps or [])[: len(out_tokens)],
                                    prompt_logprobs=plps,
                                )
                                self.on_output(out, time.monotonic())
                                if migration_span is not None:
                                    tracing.end(migration_span)
                                    migration_span = None
                                versions.tokens(len(out_tokens))
                                yield out
                                if done:
                                    return  # closing the stream aborts a request stopped by a stop string
                        raise WorkerFailed("the stream ended without finishing")
                    except WorkerFailed as e:
                        tracing.end(attempt_span, str(e))
                        attempt_span = None
                        last_error = e
                        failed.add(decode.worker_id)
                        attempts += 1
                        if not isinstance(e, WorkerMoved):
                            versions.failed(route)
                        if isinstance(e, WorkerMoved):
                            moved += 1
                            self.metrics.moved.labels(decode.worker_id).inc()
                            continue
                        migrated = await self._recover(
                            request_id, decode, e, attempts - moved, migrations, len(generated)
                        )
                        migrations += migrated
                        if migrated:
                            migration_span = tracing.start(
                                "router.migration",
                                from_worker=decode.worker_id,
                                tokens_so_far=len(generated),
                                reason=str(e),
                            )
                    finally:
                        tracing.end(attempt_span)  # ended above when it failed
            finally:
                tracing.end(migration_span, "the request ended before its stream moved on")
                versions.close()
                if key is not None:
                    self.charge_tokens(key, n_prompt + len(generated))

    async def _recover(
        self,
        request_id: str,
        decode: Worker,
        e: Exception,
        attempts: int,
        migrations: int,
        num_generated: int,
    ) -> int:
        """After a worker failed the request: back off for a retry (nothing streamed yet), allow a
        migration (tokens streamed: returns 1), or raise the 503 the client gets."""
        if not num_generated:
            if attempts > self.rc.max_retries:
                raise APIError(
                    503,
                    f"workers failed this request: {e}",
                    code="worker_failed",
                    headers={"Retry-After": "1"},
                ) from e
            decode.retries += 1
            self.metrics.retries.labels(decode.worker_id).inc()
            delay = self.rc.retry_backoff_s * (2 ** (attempts - 1)) * random.uniform(0.5, 1.5)
            log.warning("request %s: retrying in %.2fs after %s: %s", request_id, delay, decode.worker_id, e)
            await asyncio.sleep(delay)
            return 0
        if not self.rc.migration or migrations >= self.rc.max_migrations:
            raise APIError(503, f"the decode worker failed mid-stream: {e}", code="worker_failed") from e
        decode.migrations += 1
        tracing.event("migration", worker=decode.worker_id, tokens_so_far=num_generated)
        self.metrics.migrations.labels(decode.worker_id).inc()
        log.warning(
            "request %s: migrating after %d tokens from %s: %s",
            request_id,
            num_generated,
            decode.worker_id,
            e,
        )
        return 1

    async def _stream(
        self,
        route: Route,
        rid: str,
        prompt: list[int],
        generated: list[int],
        sampling: dict,
        salt: str | None,
        images: Sequence[ImageInput] = (),
        trace: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """(token ids, their logprobs, finished, finish reason, the prompt's logprobs on the first line)."""
        w, prefill = route.decode, route.prefill
        headers = dict(self.registry.headers)
        if prefill is not None and prefill.kv_endpoint:
            headers[PREFILL_HEADER] = ",".join(self._prefill_peers(prefill.kv_endpoint, route.remote_tokens))
        if trace:  # the worker's spans join this request's trace
            headers[tracing.TRACEPARENT] = trace
        body = {
            "request_id": rid,
            "prompt_token_ids": prompt,
            "output_token_ids": generated,
            "sampling": sampling,
            "cache_salt": salt,
            "images": [im.to_json() for im in images],
        }
        now = time.monotonic()
        # What the worker computes before its first token is counted until that token arrives.
        charge = Charge(
            route, len(prompt) + len(generated), max(0, (sampling.get("max_tokens") or 0) - len(generated))
        )
        judged: set[str] = set()  # workers whose breaker heard a verdict from this attempt
        for x in (w, charge.prefill):
            if x is not None:
                x.breaker.on_attempt()
                self.metrics.requests.labels(x.worker_id).inc()
        try:
            try:
                req = self.client.build_request(
                    "POST", w.url + "/internal/generate", json=body, headers=headers
                )
                started = arrived_at.get()
                if started is not None and rid.endswith("-0"):
                    self.metrics.overhead_seconds.observe(time.perf_counter() - started)
                resp = await unless_silent(
                    self.client.send(req, stream=True), lambda: w.healthy, self.rc.health_period_s
                )
            except (httpx.HTTPError, WorkerSilent) as e:
                self._failure(w, now, judged)
                raise WorkerFailed(f"{type(e).__name__}: {e}") from e
            lines = watched(resp.aiter_lines(), lambda: w.healthy, self.rc.health_period_s)
            try:
                if resp.status_code != 200:
                    await resp.aread()
                    if resp.status_code == 503 and _error_of(resp).get("code") == "switching_role":
                        raise WorkerMoved("the worker is switching role")
                    if resp.status_code == 429 or resp.status_code >= 500:
                        self._failure(w, now, judged)
                        raise WorkerFailed(f"HTTP {resp.status_code}")
                    err = _error_of(resp)
                    raise APIError(
                        resp.status_code, err.get("message", resp.text), err.get("param"), err.get("code")
                    )
                async for line in lines:
                    if not line:
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        err = msg["error"]
                        if err.get("code") == "invalid_value":
                            raise APIError(400, err.get("message", ""), err.get("param"), err.get("code"))
                        if err.get("code") == "moved":
                            raise WorkerMoved(err.get("message", "moved"))
                        self._failure(w, now, judged)
                        raise WorkerFailed(err.get("message", "worker error"))
                    tl = TokenLine.from_wire(msg)
                    if not charge.prefilled:
                        self._judge_prefill(tl, time.monotonic(), judged)
                        charge.first_token()
                    charge.generated(len(tl.token_ids))
                    lps = [TokenLogprob.from_wire(e) for e in tl.logprobs or []] or None
                    plps = (
                        None
                        if tl.prompt_logprobs is None
                        else [
                            TokenLogprob.from_wire(e) if e is not None else None for e in tl.prompt_logprobs
                        ]
                    )
                    yield tl.token_ids, lps, tl.finished, tl.finish_reason, plps
                    if tl.finished:
                        w.breaker.on_success()
                        judged.add(w.worker_id)
                        return
            except (httpx.HTTPError, json.JSONDecodeError, KeyError, WorkerSilent) as e:
                self._failure(w, time.monotonic(), judged)
                raise WorkerFailed(f"{type(e).__name__}: {e}") from e
            finally:
                await lines.aclose()  # its reader task first, then the stream it reads
                await resp.aclose()
        finally:
            charge.close()
            for x in (w, charge.prefill):
                if x is not None and x.worker_id not in judged:
                    x.breaker.on_abandon()

    def _judge_prefill(self, tl: TokenLine, now: float, judged: set[str]) -> None:
        """The decode worker's first line names the prefill worker that filled the prompt and
        those that failed to (it fell back to the next one, or to a local prefill)."""
        by_endpoint = {x.kv_endpoint: x for x in self.registry.pool("prefill") if x.kv_endpoint}
        for ep in tl.prefill_failed or ():
            if (x := by_endpoint.get(ep)) is not None:
                self._failure(x, now, judged)
        prefilled_by = tl.prefilled_by
        if prefilled_by is not None and (x := by_endpoint.get(prefilled_by)) is not None:
            x.breaker.on_success()
            judged.add(x.worker_id)

    def _failure(self, w: Worker, now: float, judged: set[str]) -> None:
        w.errors += 1
        self.metrics.errors.labels(w.worker_id).inc()
        w.breaker.on_failure(now)
        judged.add(w.worker_id)


def _error_of(resp: httpx.Response) -> dict:
    try:
        return resp.json().get("error") or {}
    except ValueError:
        return {}
