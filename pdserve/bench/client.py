"""The load client: streams requests through the OpenAI API and records what it sees.

One asyncio loop drives every request over httpx, which keeps the client's own CPU cost low (it
shares a 2-core machine with the server under test). Failures of any kind become an error kind on
the request's record; nothing a server does makes the benchmark raise.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from .metrics import RequestRecord
from .workloads import Session


@dataclass
class ClientConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    api: str = "chat"  # "chat" -> /v1/chat/completions, "completions" -> /v1/completions
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0


def _headers(cfg: ClientConfig) -> dict:
    h = {"Content-Type": "application/json"}
    if cfg.api_key:
        h["Authorization"] = f"Bearer {cfg.api_key}"
    return h


def _root(base_url: str) -> str:
    # Accept both "http://h:p" and "http://h:p/v1", as OpenAI clients do.
    u = base_url.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


async def discover_model(cfg: ClientConfig) -> str:
    """The first model that GET /v1/models lists; the name every request is sent with."""
    async with httpx.AsyncClient(timeout=cfg.connect_timeout_s) as c:
        r = await c.get(_root(cfg.base_url) + "/v1/models", headers=_headers(cfg))
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError("the server lists no models")
        return data[0]["id"]


def _error_kind(e: BaseException) -> str:
    """A short stable name per failure, so the report can count them.

    A server killed mid-run shows up as connection_dropped for streams in flight and
    connect_error for requests sent afterwards.
    """
    if isinstance(e, httpx.ConnectError):
        return "connect_error"
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, httpx.RemoteProtocolError):
        return "connection_dropped"
    if isinstance(e, (httpx.ReadError, httpx.WriteError)):
        return "connection_dropped"
    if isinstance(e, httpx.HTTPError):
        return "http_error"
    if isinstance(e, json.JSONDecodeError):
        return "bad_response"
    return "client_" + type(e).__name__


def build_body(
    cfg: ClientConfig, model: str, messages: list[dict] | None, prompt: str | None, max_tokens: int
) -> dict:
    body: dict = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream_options": {"include_usage": True},
    }
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        # Not in the OpenAI spec; vLLM, llama-server and pdserve read it. Fixed-length replies
        # make systems comparable however soon each model would have stopped.
        body["ignore_eos"] = True
    return body


async def stream_one(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    model: str,
    rec: RequestRecord,
    messages: list[dict] | None = None,
    prompt: str | None = None,
    max_tokens: int = 128,
) -> RequestRecord:
    """Send one streaming request and fill `rec` (times, tokens, text, or an error kind)."""
    path = "/v1/chat/completions" if messages is not None else "/v1/completions"
    body = build_body(cfg, model, messages, prompt, max_tokens)
    text: list[str] = []
    done = False
    rec.start = time.perf_counter()
    try:
        async with client.stream(
            "POST", _root(cfg.base_url) + path, json=body, headers=_headers(cfg)
        ) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = f"http_{resp.status_code}"
                rec.error_detail = raw[:300].decode(errors="replace")
                return rec
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments and keep-alives
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                err = chunk.get("error")
                if err:
                    rec.error = "server_error"
                    rec.error_detail = str(err.get("message", err) if isinstance(err, dict) else err)
                    return rec
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    rec.completion_tokens = chunk["usage"].get("completion_tokens")
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                    if piece:
                        rec.chunk_times.append(now)
                        text.append(piece)
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
        if not done:
            # The body ended cleanly but without [DONE]: a server that gave up half way.
            rec.error = "stream_truncated"
    except Exception as e:  # noqa: BLE001 - every failure is data for the report
        rec.error = _error_kind(e)
        rec.error_detail = f"{type(e).__name__}: {e}"[:300]
    finally:
        rec.end = time.perf_counter()
        rec.text = "".join(text)
    return rec


async def run_session(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    model: str,
    s: Session,
    on_done: Callable[[RequestRecord], None],
) -> list[RequestRecord]:
    """Send a session's turns in order, each with the history and the server's real replies.

    When a turn fails the rest cannot be sent faithfully; they are recorded as failed with kind
    `conversation_aborted`, so completed + failed always equals the requests asked for.
    """
    history: list[dict] = list(s.preset or [])
    if s.system:
        history.insert(0, {"role": "system", "content": s.system})
    out: list[RequestRecord] = []
    for i, turn in enumerate(s.turns):
        rec = RequestRecord(id=f"{s.id}.{i}", tag=s.tag)
        if out and not out[-1].ok:
            rec.error = "conversation_aborted"
        elif cfg.api == "completions" and len(s.turns) == 1 and not s.preset:
            # Raw completion: no chat template, so the prompt is exactly the text (the system
            # text, if any, goes first). Conversations always go through the chat endpoint.
            prompt = f"{s.system}\n\n{turn.text}" if s.system else turn.text
            await stream_one(client, cfg, model, rec, prompt=prompt, max_tokens=turn.max_tokens)
        else:
            history.append({"role": "user", "content": turn.text})
            await stream_one(client, cfg, model, rec, messages=list(history), max_tokens=turn.max_tokens)
            history.append({"role": "assistant", "content": rec.text})
        out.append(rec)
        on_done(rec)
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of n Poisson arrivals at `rate` per second; the first comes at 0."""
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(
    cfg: ClientConfig,
    sessions: list[Session],
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
    model: str | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run every session; returns (records in session order, wall seconds of the run).

    concurrency alone: a closed loop of that many sessions in flight. request_rate: sessions start
    at Poisson arrivals; with a concurrency as well, at most that many are in flight (arrivals
    wait for a slot, as vLLM's --max-concurrency does).
    """
    if model is None:
        model = cfg.model
    if model is None:
        try:
            model = await discover_model(cfg)
        except Exception as e:  # noqa: BLE001 - an unreachable server is a result, not a crash
            model = "default"
            err = _error_kind(e)
            recs = []
            for s in sessions:
                for i in range(len(s.turns)):
                    r = RequestRecord(
                        id=f"{s.id}.{i}", tag=s.tag, error=err, error_detail=f"GET /v1/models: {e}"[:300]
                    )
                    on_done(r)
                    recs.append(r)
            return recs, 0.0
    width = concurrency or len(sessions)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s, pool=None)
    results: list[list[RequestRecord] | None] = [None] * len(sessions)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        if request_rate is None:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(sessions)):
                queue.put_nowait(i)

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    results[i] = await run_session(client, cfg, model, sessions[i], on_done)

            await asyncio.gather(*(worker() for _ in range(min(width, len(sessions)))))
        else:
            gate = asyncio.Semaphore(width)
            offsets = poisson_arrivals(len(sessions), request_rate, seed)

            async def arrive(i: int, at: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                async with gate:
                    results[i] = await run_session(client, cfg, model, sessions[i], on_done)

            await asyncio.gather(*(arrive(i, at) for i, at in enumerate(offsets)))
        # The run ends with the last reply; a client pause after it is not the server's time.
        ends = [r.end for rs in results if rs for r in rs if r.end is not None]
        duration = (max(ends) if ends else time.perf_counter()) - t0
    return [r for rs in results if rs for r in rs], duration
