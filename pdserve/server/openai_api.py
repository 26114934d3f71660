"""OpenAI-compatible handlers: /v1/completions and /v1/chat/completions, streaming and not."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# Torch-free imports only: the router runs these handlers too (tests/test_import_contracts.py).
from pdserve.chat_content import chat_inputs, chat_messages
from pdserve.common import structured
from pdserve.common.errors import EngineDeadError, InvalidParam, RequestFailed
from pdserve.common.images import ImageInput, ImageSlots, expand_image_tokens
from pdserve.common.outputs import RequestOutput, TokenLogprob
from pdserve.common.reasoning import ReasoningParser
from pdserve.common.reasoning import split as split_reasoning
from pdserve.common.sampling import SamplingParams, check_cache_salt, check_choices
from pdserve.common.tokenizer import TokenizerWrapper
from pdserve.config import VisionConfig
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, model_card, new_id, now
from pdserve.server import tool_calls
from pdserve.server.body_limit import install_body_limit
from pdserve.server.errors import APIError, error_body, install_error_handlers
from pdserve.server.metrics import RequestTimer, ServerMetrics
from pdserve.server.tokenize_api import install_tokenize_api

_DISCONNECT_POLL_S = 0.5
PREFILL_HEADER = "x-pdserve-prefill"  # set by the router: the prefill worker's bootstrap endpoint
LLMD_PREFILL_HEADER = "x-prefiller-host-port"  # llm-d's: the prefill worker's HTTP host:port (prefiller.py)
log = logging.getLogger(__name__)


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cache_salt: str | None = None
    prefill_peer: str | None = None  # the prefill worker the router chose (PD deployments)
    images: list[ImageInput] = field(default_factory=list)  # a VLM prompt's images
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for: one per prompt token


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    p = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        repetition_penalty=req.repetition_penalty or 1.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logprobs=logprobs,
        logit_bias=dict(req.logit_bias or {}),
        prompt_logprobs=req.prompt_logprobs,
    )
    c = structured.from_request(req.response_format, req.structured_outputs, req.guided())
    p.structured = c.to_wire() if c is not None else None
    if req.stream and req.prompt_logprobs is not None:
        raise InvalidParam("prompt_logprobs is not supported with stream", "prompt_logprobs")
    return p


def check_sizes(req: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
    """The per-request work a client sets (choices, the salt hashed into every block), bounded
    before any prompt is tokenized."""
    try:
        check_choices(req.n, num_prompts)
        check_cache_salt(req.cache_salt)
    except InvalidParam as e:
        raise APIError(400, str(e), e.param, "invalid_value") from e


class InlineEncoder:
    """Tokenizes on the calling thread (a worker); the router uses a process pool instead."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self.tokenizer = tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.tokenizer.encode_chat(
            messages, add_generation_prompt, add_special_tokens, template_kwargs
        )


class GenerationBackend(Protocol):
    """What the handlers need: the worker's AsyncEngine or the router's RemoteBackend."""

    accepting: bool

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prefill_peer: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...


class OpenAIHandlers:
    """The OpenAI API over a generation backend: the worker's AsyncEngine, or the router's
    RemoteBackend (same `generate`, `check_request`, `accepting`)."""

    def __init__(
        self,
        engine: GenerationBackend,
        tokenizer: TokenizerWrapper,
        model_name: str,
        timer: RequestTimer,
        encoder: Any = None,
        aliases: list[str] | None = None,
    ) -> None:
        """`aliases`: every model id clients may send (`model_name`, the one responses name, first)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_names = list(dict.fromkeys([model_name, *(aliases or [])]))
        self.timer = timer
        self.encoder = encoder or InlineEncoder(tokenizer)
        self.vision: ImageSlots | None = None  # set for a vision-language model: image_url parts are read
        self.reasoning: str | None = None  # server.reasoning_parser: chat answers' reasoning_content
        self.tool_call_parser: str | None = None  # server.tool_call_parser (None: from the template)
        self.vision_limits = VisionConfig()
        # A decode worker: resolves llm-d's prefill header (x-prefiller-host-port) to a KV endpoint.
        self.prefill_resolver: Any = None

    async def _prefill_peer(self, http: Request) -> str | None:
        """The prefill worker to pull the prompt's KV from: pdserve's header, else llm-d's (resolved),
        else None (prefill here)."""
        peer = http.headers.get(PREFILL_HEADER)
        if peer or self.prefill_resolver is None:
            return peer
        return await self.prefill_resolver.resolve(http.headers.get(LLMD_PREFILL_HEADER))

    def _envelope(self, base_id: str, obj: str, **fields: Any) -> dict[str, Any]:
        """The fields every OpenAI response and chunk starts with."""
        return {"id": base_id, "object": obj, "created": now(), "model": self.model_name, **fields}

    def _check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise APIError(
                400,
                f"the model {name!r} does not exist; this server serves {', '.join(map(repr, self.model_names))}",
                "model",
                "model_not_found",
            )

    def _choices(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        cache_salt: str | None = None,
        prefill_peer: str | None = None,
    ) -> list[Choice]:
        choices = []
        for pi, ids in enumerate(prompts):
            for j in range(n):
                p = params
                if n > 1 and params.seed is not None:  # distinct but reproducible samples per choice
                    p = SamplingParams(**{**params.__dict__, "seed": params.seed + j})
                choices.append(Choice(pi * n + j, ids, p, cache_salt=cache_salt, prefill_peer=prefill_peer))
        for c in choices:
            try:
                self.engine.check_request(c.prompt_ids, c.params)
            except InvalidParam as e:
                raise APIError(400, str(e), e.param, "invalid_value") from e
        return choices

    async def _events(
        self, base_id: str, choices: list[Choice]
    ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Run every choice's request; yield outputs as they come. Closing this aborts them all."""
        if not self.engine.accepting:
            raise APIError(
                503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "1"}
            )
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            rid = f"{base_id}-{c.index}"
            self.timer.start(rid, time.monotonic(), c.params.max_tokens)
            try:
                extra = {"images": c.images} if c.images else {}
                async for out in self.engine.generate(
                    rid, c.prompt_ids, c.params, c.cache_salt, c.prefill_peer, **extra
                ):
                    await queue.put((c, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((c, e))
            finally:
                self.timer.forget(rid)  # a request that failed or was cancelled leaves nothing behind

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(choices)
            while remaining:
                c, item = await queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, InvalidParam):
                        raise APIError(400, str(item), item.param, "invalid_value")
                    if isinstance(item, EngineDeadError):
                        raise APIError(503, str(item), code="engine_dead")
                    if isinstance(item, RequestFailed):
                        raise APIError(502, str(item), code="request_failed")
                    raise item
                c.token_ids.extend(item.new_token_ids)
                c.text += item.new_text
                c.logprobs.extend(item.new_logprobs)
                if item.prompt_logprobs is not None:
                    c.prompt_logprobs = item.prompt_logprobs
                if item.finished:
                    c.finish_reason = item.finish_reason
                    remaining -= 1
                yield c, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, http: Request, base_id: str, choices: list[Choice]) -> None:
        """Run to completion; a client that goes away aborts its requests."""

        async def run() -> None:
            async for _ in self._events(base_id, choices):
                pass

        task = asyncio.create_task(run())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not done and await http.is_disconnected():
                log.info("client of %s disconnected", base_id)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected")
        task.result()

    async def _stream(
        self, base_id: str, choices: list[Choice], make_chunk, include_usage: bool, object_name: str
    ) -> StreamingResponse:
        # The first output comes before the response starts: a request refused before any token
        # (shutting down, no decode worker can take it, the queue is full) gets its status and
        # Retry-After, which a client can act on, not a 200 whose stream carries the error.
        events = self._events(base_id, choices)
        try:
            head = await anext(events)
        except StopAsyncIteration:
            head = None
        except BaseException:
            await events.aclose()
            raise

        async def outputs() -> AsyncIterator[tuple[Choice, RequestOutput]]:
            if head is not None:
                yield head
                async for item in events:
                    yield item

        async def body() -> AsyncIterator[str]:
            try:
                first = {c.index: True for c in choices}
                async for c, out in outputs():
                    chunk = make_chunk(c, out, first[c.index])
                    first[c.index] = False
                    if chunk is not None:
                        if include_usage:
                            chunk["usage"] = None
                        yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage:
                    final = self._envelope(base_id, object_name, choices=[], usage=_usage(choices))
                    yield f"data: {json.dumps(final)}\n\n"
            except APIError as e:
                yield f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"
            finally:
                await events.aclose()  # a client gone mid-stream aborts its requests
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # ------------------------------------------------------------------ /v1/completions

    async def completions(self, req: CompletionRequest, http: Request):
        self._check_model(req.model)
        check_sizes(req, _num_prompts(req.prompt))
        prompts = await _prompt_lists(req.prompt, self.encoder)
        try:
            params = sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
        except InvalidParam as e:
            raise APIError(400, str(e), e.param, "invalid_value") from e
        if req.stream and req.echo:
            raise APIError(400, "echo is not supported with stream", "echo", "invalid_value")
        if req.echo and req.logprobs is not None:  # the echoed prompt's tokens carry theirs too
            params.prompt_logprobs = max(params.prompt_logprobs or 0, req.logprobs)
        choices = self._choices(prompts, params, req.n, req.cache_salt, await self._prefill_peer(http))
        base_id = new_id("cmpl")
        tok = self.tokenizer

        def completion_chunk(c: Choice, out: RequestOutput, first: bool) -> dict | None:
            if not out.new_text and not out.finished:
                return None
            lp = _completion_logprobs(out.new_logprobs, tok) if c.params.logprobs is not None else None
            return self._envelope(
                base_id,
                "text_completion",
                choices=[
                    {
                        "index": c.index,
                        "text": out.new_text,
                        "logprobs": lp,
                        "finish_reason": out.finish_reason if out.finished else None,
                    }
                ],
            )

        if req.stream:
            return await self._stream(
                base_id,
                choices,
                completion_chunk,
                bool(req.stream_options and req.stream_options.include_usage),
                "text_completion",
            )
        await self._collect(http, base_id, choices)
        return JSONResponse(
            self._envelope(
                base_id,
                "text_completion",
                choices=[
                    {
                        "index": c.index,
                        "text": (tok.decode(c.prompt_ids) if req.echo else "") + c.text,
                        "logprobs": _completion_logprobs(
                            c.logprobs, tok, (c.prompt_ids, c.prompt_logprobs) if req.echo else None
                        )
                        if c.params.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                        **_vllm_prompt_logprobs(req.prompt_logprobs, c, tok),
                    }
                    for c in choices
                ],
                usage=_usage(choices),
            )
        )

    # ------------------------------------------------------------------ /v1/chat/completions

    async def chat(self, req: ChatCompletionRequest, http: Request):
        self._check_model(req.model)
        check_sizes(req, 1)
        images: list[ImageInput] = []
        if self.vision is None:
            messages = chat_messages(req.messages, self.model_name)
        else:  # decoding images takes a while: off the event loop
            inputs = await asyncio.to_thread(
                chat_inputs, req.messages, self.model_name, self.vision.placeholder, self.vision_limits
            )
            messages = inputs.messages
        template = self.tokenizer.chat_template
        try:
            tools = tool_calls.plan(req, self.tool_call_parser, template)
        except InvalidParam as e:
            raise APIError(400, str(e), e.param, "invalid_value") from e
        messages = tool_calls.template_messages(messages, tools, template)
        kwargs = {**(req.chat_template_kwargs or {}), **(tools.template_kwargs() if tools else {})}
        try:
            prompt = await self.encoder.encode_chat(messages, True, False, kwargs or None)
            if self.vision is not None and inputs.images:
                prompt, images = expand_image_tokens(
                    prompt, self.vision.image_token_id, self.vision.tokens_per_image, inputs.images
                )
        except ValueError as e:
            raise APIError(400, str(e), "messages", "invalid_value") from e
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        try:
            params = sampling_params(req, max_tokens, (top or 0) if req.logprobs else None)
        except InvalidParam as e:
            raise APIError(400, str(e), e.param, "invalid_value") from e
        if tools is not None and tools.constraint is not None:
            if params.structured is not None:
                raise APIError(
                    400,
                    "tool_choice required or a named function constrains the output: no response_format "
                    "or structured_outputs with it",
                    "tool_choice",
                    "invalid_value",
                )
            params.structured = tools.constraint.to_wire()
        choices = self._choices([prompt], params, req.n, req.cache_salt, await self._prefill_peer(http))
        for c in choices:
            c.images = images
        base_id = new_id("chatcmpl")
        tok = self.tokenizer

        parsers = {c.index: ReasoningParser(self.reasoning) for c in choices} if self.reasoning else {}
        readers = {c.index: tools.reader() for c in choices} if tools else {}

        def chat_chunk(c: Choice, out: RequestOutput, first: bool) -> dict | None:
            reasoning, text = "", out.new_text
            if parsers:
                reasoning, text = parsers[c.index].feed(out.new_text)
                if out.finished:
                    more = parsers[c.index].finish()
                    reasoning, text = reasoning + more[0], text + more[1]
            calls: list = []
            if readers:  # tool calls are read from the answer after its reasoning
                r = readers[c.index]
                text, calls = r.feed(text)
                if out.finished:
                    more_text, more_calls = r.finish()
                    text, calls = text + more_text, calls + more_calls
            if not text and not reasoning and not calls and not out.finished and not first:
                return None
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = [d.to_openai() for d in calls]
            lp = {"content": _chat_logprobs(out.new_logprobs, tok)} if req.logprobs else None
            reason = out.finish_reason if out.finished else None
            if reason == "stop" and readers and readers[c.index].calls and tools and tools.choice != "named":
                reason = "tool_calls"
            return self._envelope(
                base_id,
                "chat.completion.chunk",
                choices=[{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}],
            )

        if req.stream:
            return await self._stream(
                base_id,
                choices,
                chat_chunk,
                bool(req.stream_options and req.stream_options.include_usage),
                "chat.completion.chunk",
            )
        await self._collect(http, base_id, choices)
        return JSONResponse(
            self._envelope(
                base_id,
                "chat.completion",
                choices=[
                    _chat_choice(c, _message(c.text, self.reasoning, tools), tools, req.logprobs, tok)
                    for c in choices
                ],
                # vLLM's place for a chat request's prompt logprobs: beside the choices.
                **_vllm_prompt_logprobs(req.prompt_logprobs, choices[0], tok),
                usage=_usage(choices),
            )
        )


def _message(text: str, reasoning: str | None, tools: tool_calls.ToolPlan | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        thought, msg["content"] = split_reasoning(reasoning, text)
        msg["reasoning_content"] = thought or None
    if tools is not None:
        msg["content"], calls = tool_calls.message(tools, msg["content"])
        msg["tool_calls"] = calls
    return msg


def _chat_choice(
    c: Choice, msg: dict[str, Any], tools: tool_calls.ToolPlan | None, logprobs: bool, tok: TokenizerWrapper
) -> dict[str, Any]:
    """A whole chat answer's choice. A natural stop after tool calls is "tool_calls" (a named
    function's forced call stays "stop"), read from the message's own calls."""
    reason = c.finish_reason
    if reason == "stop" and tools is not None and tools.choice != "named" and msg.get("tool_calls"):
        reason = "tool_calls"
    return {
        "index": c.index,
        "message": msg,
        "logprobs": {"content": _chat_logprobs(c.logprobs, tok)} if logprobs else None,
        "finish_reason": reason,
    }


def _num_prompts(prompt: Any) -> int:
    """Prompts in a completion request's `prompt`: a string or a list of token ids is one."""
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


async def _prompt_lists(prompt: Any, encoder: InlineEncoder) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await encoder.encode(prompt)]
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [await encoder.encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(
        400, "prompt must be a string, a list of strings or a list of token ids", "prompt", "invalid_value"
    )


def _usage(choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(ids) for ids in {id(c.prompt_ids): c.prompt_ids for c in choices}.values())
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(
    entries: list[TokenLogprob],
    tok: TokenizerWrapper,
    echoed: tuple[list[int], list[TokenLogprob | None] | None] | None = None,
) -> dict[str, Any]:
    """OpenAI's completion logprobs; `echoed`: the prompt's ids and logprobs (None for the first
    token, which nothing predicts), listed before the generated tokens as the echoed text has them."""
    ids: list[int] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if echoed is not None:
        prompt_ids, prompt_lps = echoed
        for i, t in enumerate(prompt_ids):
            e = prompt_lps[i] if prompt_lps is not None and i < len(prompt_lps) else None
            ids.append(t)
            lps.append(None if e is None else e.logprob)
            tops.append(None if e is None else {tok.token_text(x): lp for x, lp in [(t, e.logprob), *e.top]})
    for e in entries:
        ids.append(e.token_id)
        lps.append(e.logprob)
        tops.append({tok.token_text(t): lp for t, lp in e.top})
    texts = [tok.token_text(t) for t in ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _vllm_prompt_logprobs(asked: int | None, c: Choice, tok: TokenizerWrapper) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` field when asked for: None for the first prompt token, then per token
    {token id: {logprob, rank, decoded_token}} for the prompt's own token and the top alternatives."""
    if asked is None:
        return {}
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, t in enumerate(c.prompt_ids):
        e = c.prompt_logprobs[i] if c.prompt_logprobs is not None and i < len(c.prompt_logprobs) else None
        if e is None:
            out.append(None)
            continue
        ranked = {t: (e.logprob, e.rank)}
        for r, (x, lp) in enumerate(e.top, start=1):
            ranked.setdefault(x, (lp, r))
        out.append(
            {
                str(x): {"logprob": lp, "rank": r, "decoded_token": tok.token_text(x)}
                for x, (lp, r) in ranked.items()
            }
        )
    return {"prompt_logprobs": out}


def _chat_logprobs(entries: list[TokenLogprob], tok: TokenizerWrapper) -> list[dict[str, Any]]:
    def item(t: int, lp: float) -> dict[str, Any]:
        text = tok.token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
    ]


def install_openai_api(
    app: FastAPI,
    handlers: OpenAIHandlers,
    metrics: ServerMetrics,
    max_model_len: Callable[[], int],
    max_body_bytes: int,
) -> None:
    """The OpenAI routes with their error bodies, the body-size limit and /metrics: the same on a
    worker and on the router (middleware added after this wraps outside the size limit)."""
    install_error_handlers(app, on_error=lambda status: metrics.errors.labels(str(status)).inc())
    install_body_limit(app, max_body_bytes, on_reject=lambda: metrics.errors.labels("413").inc())

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n, max_model_len()) for n in handlers.model_names]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        return await handlers.completions(req, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request):
        return await handlers.chat(req, http)

    install_tokenize_api(app, handlers, max_model_len)
