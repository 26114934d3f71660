"""The per-request work a client sets is bounded at the router, before any prompt is tokenized or
routed: choices (n times the prompts), the cache salt, stop strings, and sampling values that would
break a sampler. Each gets a 400 naming its parameter. The router app is the real one
(create_router_app), spoken to over ASGI in this process; with no worker registered, a request that
passes the checks gets the 503 of no decode worker instead."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from api_errors import openai_error

from pdserve.config import load_config

MODEL = "tiny-qwen2"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": [11, 12, 13], "max_tokens": 4}


def _post(path: str, body: dict) -> httpx.Response:
    from pdserve.router.gateway import create_router_app

    app = create_router_app(load_config(overrides={"model.name": MODEL, "router.encoder_workers": 0}))
    # json.dumps writes NaN and Infinity, which the server's JSON parser reads back as floats.
    content = json.dumps({"model": MODEL, **body})

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            return await c.post(path, content=content, headers={"content-type": "application/json"})

    return asyncio.run(go())


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "prompt": [[11, 12]] * 65, "n": 2}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a b"] * 129}, "prompt"),
        ("/v1/completions", {**COMPLETION, "n": 17}, "n"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
        ("/v1/completions", {**COMPLETION, "cache_salt": "s" * 257}, "cache_salt"),
        ("/v1/chat/completions", {**CHAT, "cache_salt": "s" * 1_000_000}, "cache_salt"),
        ("/v1/completions", {**COMPLETION, "stop": ["x"] * 17}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": ["y" * 257]}, "stop"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": list(range(257))}, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "temperature": 1e-40}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "repetition_penalty": 1e-40}, "repetition_penalty"),
        ("/v1/completions", {**COMPLETION, "temperature": float("nan")}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": float("inf")}, "temperature"),
        ("/v1/completions", {**COMPLETION, "repetition_penalty": float("nan")}, "repetition_penalty"),
        ("/v1/chat/completions", {**CHAT, "top_p": float("nan")}, "top_p"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"11": 101}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"eleven": 1}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"11": "much"}}, "logit_bias"),
    ],
)
def test_over_the_limit_is_a_400_naming_the_parameter(path, body, param):
    err = openai_error(_post(path, body), 400)
    assert err["param"] == param and err["code"] == "invalid_value", err


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {**COMPLETION, "prompt": [[11, 12]] * 8, "n": 16}),
        ("/v1/completions", {**COMPLETION, "cache_salt": "s" * 256, "stop": ["z" * 256] * 16}),
        ("/v1/chat/completions", {**CHAT, "n": 16, "temperature": 0.01, "repetition_penalty": 100}),
    ],
)
def test_at_the_limit_the_request_is_routed(path, body):
    err = openai_error(_post(path, body), 503)
    assert err["code"] == "no_workers"
