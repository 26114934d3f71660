"""A streamed request the router refuses before any token (no decode worker can take it) gets the
refusal as its HTTP status, with Retry-After and an OpenAI-style body, not a 200 whose event stream
carries the error: clients and their retry logic act on the status. The router app is the real one
(create_router_app), spoken to over ASGI in this process."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from api_errors import openai_error

from pdserve.config import load_config


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": [11, 12, 13], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ],
)
def test_a_stream_refused_before_its_first_token_gets_a_503(path, body):
    from pdserve.router.gateway import create_router_app

    app = create_router_app(load_config(overrides={"model.name": "tiny-qwen2", "router.encoder_workers": 0}))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            return await c.post(path, json={"model": "tiny-qwen2", "stream": True, **body})

    r = asyncio.run(go())
    err = openai_error(r, 503)
    assert err["code"] == "no_workers" and "no decode worker" in err["message"]
    assert r.headers["retry-after"] == "1"
    assert r.headers["content-type"].startswith("application/json")
