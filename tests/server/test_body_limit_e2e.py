"""`server.max_body_bytes` holds for bodies without a Content-Length: a chunked upload over the limit
gets a 413 with the OpenAI error body from the router, from a worker's OpenAI API and from a worker's
internal routes, and the server stays up. The body is a valid request padded with whitespace, so a
server that reads it whole would answer it. A chunked body under the limit is still served."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.server.body_limit import install_body_limit

MODEL = "tiny-qwen2"
LIMIT = 4000
pytestmark = pytest.mark.slow
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Hello"}],
    "max_tokens": 2,
    "temperature": 0.0,
}
GENERATE = {"request_id": "body-limit-1", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    (d / "c.yaml").write_text(f"model: {{name: {MODEL}}}\nserver: {{max_body_bytes: {LIMIT}}}\n")
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--config",
        str(d / "c.yaml"),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--port",
        str(port),
    ]
    with ServerProcess(cmd, port, d / "log") as srv:
        srv.wait_ready(timeout=300)
        workers = httpx.get(srv.url + "/admin/workers", timeout=10).json()["workers"]
        yield {"router": srv.url, "worker": next(w["url"] for w in workers if w["role"] == "decode")}


def _chunked(body: dict, pad: int):
    """The JSON of `body` with `pad` spaces before its closing brace, in 64 KiB chunks (no length:
    httpx sends a generator with Transfer-Encoding: chunked)."""
    text = json.dumps(body).encode()
    yield text[:-1]
    chunk = b" " * 65536
    for _ in range(pad // len(chunk)):
        yield chunk
    yield b" " * (pad % len(chunk)) + b"}"


def _post(url: str, body: dict, pad: int) -> httpx.Response:
    return httpx.post(
        url, content=_chunked(body, pad), headers={"content-type": "application/json"}, timeout=120
    )


def _too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert (
        err["code"] == "body_too_large"
        and err["type"] == "invalid_request_error"
        and str(LIMIT) in err["message"]
    )


@pytest.mark.parametrize("front", ["router", "worker"])
def test_chunked_bodies_over_the_limit_get_413(urls, front):
    url = urls[front] + "/v1/chat/completions"
    assert _post(url, CHAT, 100).status_code == 200  # chunked and small: served
    _too_large(_post(url, CHAT, 2 * LIMIT))
    _too_large(_post(url, CHAT, 8 << 20))  # 8 MiB: refused, not read into memory
    assert httpx.post(url, json=CHAT, timeout=120).status_code == 200


def test_a_workers_internal_routes_count_chunked_bodies_too(urls):
    url = urls["worker"] + "/internal/generate"
    _too_large(_post(url, GENERATE, 8 << 20))
    _too_large(_post(urls["worker"] + "/internal/role", {"role": "decode"}, 2 * LIMIT))
    assert httpx.get(urls["worker"] + "/health", timeout=10).status_code == 200


def test_the_middleware_stops_reading_at_the_limit():
    """Straight through ASGI: the app asks for the body, and no message past the one that crossed the
    limit is ever taken from the server."""
    app = FastAPI()
    install_body_limit(app, 1000)

    @app.post("/echo")
    async def echo(req: Request):
        return {"n": len(await req.body())}

    async def call(n_chunks: int) -> tuple[int, int, dict]:
        taken = 0

        async def receive():
            nonlocal taken
            taken += 1
            return {"type": "http.request", "body": b"x" * 100, "more_body": taken < n_chunks}

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/echo",
            "raw_path": b"/echo",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"transfer-encoding", b"chunked")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        await app(scope, receive, send)
        body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
        return sent[0]["status"], taken, body

    assert asyncio.run(call(10)) == (200, 10, {"n": 1000})
    status, taken, body = asyncio.run(call(100_000))
    assert (status, taken) == (413, 11) and body["error"]["code"] == "body_too_large"
