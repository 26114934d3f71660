"""Structured outputs and tool calls through `pdserve serve` (PD: a router, a prefill and two decode
workers as real processes) and the official openai client, with a tiny random model, so only the
grammar keeps an output valid:
- 50 JSON schemas of varied shape at temperature 1, over shm and over tcp: 100% validate;
- a decode worker killed mid-stream: the migrated streams rebuild their grammar state and still
  validate;
- 200 of 200 tool_choice "required" requests (streamed and not) return calls whose arguments parse
  and match their tool's schema; a named function; a full round trip (call, tool result, answer)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from pdserve.bench.json_schemas import schemas
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen2"
MESSAGES = [{"role": "user", "content": "Describe a record as JSON."}]


def _serve(tmp_path, backend: str) -> ServerProcess:
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--model", MODEL, "--prefill", "1", "--decode", "2"]
    cmd += ["--port", str(port), "--transfer-backend", backend]
    return ServerProcess(cmd, port, tmp_path / f"serve-{backend}.log")


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}


def _check_fifty_schemas(client: openai.OpenAI) -> None:
    cases = schemas(50)

    def one(i: int) -> tuple[str, str | None]:
        kw = {"model": MODEL, "temperature": 1.0, "seed": i, "max_tokens": 400}
        if i % 2:  # chat with response_format, streamed
            chunks = client.chat.completions.create(
                messages=MESSAGES, response_format=_schema_format(cases[i]), stream=True, **kw
            )
            text, reason = "", None
            for ch in chunks:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    reason = ch.choices[0].finish_reason or reason
            return text, reason
        r = client.completions.create(
            prompt="JSON:", extra_body={"structured_outputs": {"json": cases[i]}}, **kw
        )
        return r.choices[0].text, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(len(cases))))
    for i, (text, reason) in enumerate(results):
        assert reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), cases[i])


def _workers(url: str) -> list[dict]:
    return httpx.get(url + "/admin/workers").json()["workers"]


# Stream 0's schema asks for 32 strings of 10 to 12 characters (some 150 decode steps): its decode
# worker, stopped after three chunks, is still decoding it.
LONG = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "minLength": 10, "maxLength": 12},
            "minItems": 32,
            "maxItems": 32,
        }
    },
    "required": ["items"],
}


def _in_flight(url: str, worker_id: str) -> int:
    return next(w["load"]["in_flight"] for w in _workers(url) if w["id"] == worker_id)


def _kill_mid_stream(url: str, victim: dict) -> bool:
    """SIGKILL the victim while the router still waits for a stream of it; False (and the victim
    left running) when it has none left. Stopped first, and given a second, so that the router has
    read whatever the worker sent before it stopped: what it still waits for never comes."""
    os.kill(victim["pid"], signal.SIGSTOP)
    time.sleep(1.0)
    if _in_flight(url, victim["id"]) == 0:
        os.kill(victim["pid"], signal.SIGCONT)
        return False
    os.kill(victim["pid"], signal.SIGKILL)
    return True


def _check_migration(srv: ServerProcess) -> None:
    """Four constrained streams; after three chunks of the first, its decode worker is killed while
    it still decodes that stream: the stream moves, rebuilds its grammar state and validates."""
    client = _client(srv)
    cases = [LONG] + schemas(3, seed=21)

    def open_stream(i: int, seed: int):
        return client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=_schema_format(cases[i]),
            temperature=1.0,
            seed=seed + i,
            max_tokens=600,
            stream=True,
        )

    for attempt in range(3):  # a machine that finished every stream within a second of the stop: again
        before = {w["id"]: w["requests"] for w in _workers(srv.url)}
        streams = [open_stream(0, 100 * attempt)]
        [victim] = [
            w for w in _workers(srv.url) if w["role"] == "decode" and w["requests"] > before.get(w["id"], 0)
        ]
        streams += [open_stream(i, 100 * attempt) for i in range(1, len(cases))]
        texts = ["" for _ in cases]
        killed = False
        for n, ch in enumerate(streams[0]):
            if ch.choices:
                texts[0] += ch.choices[0].delta.content or ""
            if n == 3:
                killed = _kill_mid_stream(srv.url, victim)
        for i, s in enumerate(streams[1:], 1):
            texts[i] = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
        for text, schema in zip(texts, cases):
            jsonschema.validate(json.loads(text), schema)
        if killed:
            break
    assert killed, "the victim had finished its streams each time it was stopped"
    assert {w["id"]: w["migrations"] for w in _workers(srv.url)}[victim["id"]] >= 1


def _tools() -> list[dict]:
    return [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "a tool", "parameters": s}}
        for i, s in enumerate(schemas(4, seed=33))
    ]


def _check_required_tool_calls(client: openai.OpenAI) -> None:
    tools = _tools()
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def one(i: int) -> list[tuple[str, str]]:
        kw = {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "temperature": 1.0,
            "seed": i,
            "max_tokens": 400,
        }
        if i % 2 == 0:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "tool_calls"
            return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
        calls: dict[int, list[str]] = {}
        reason = None
        for ch in client.chat.completions.create(stream=True, **kw):
            if not ch.choices:
                continue
            reason = ch.choices[0].finish_reason or reason
            for d in ch.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                if d.id:
                    assert d.function.name, "the first delta of a call names it"
                    entry[0] = d.function.name
                entry[1] += d.function.arguments or ""
        assert reason == "tool_calls"
        return [(name, args) for name, args in calls.values()]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(200)))
    for calls in results:
        assert len(calls) == 1
        name, args = calls[0]
        jsonschema.validate(json.loads(args), by_name[name])


def _check_named_and_round_trip(client: openai.OpenAI) -> None:
    tools = _tools()
    named = {"type": "function", "function": {"name": "tool_2"}}
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice=named, temperature=1.0, max_tokens=400
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "tool_2" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), tools[2]["function"]["parameters"])
    # The call goes back as the assistant's message, the tool's result after it, and an answer comes.
    history = MESSAGES + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"result": 42}'},
    ]
    r2 = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, temperature=0, max_tokens=8
    )
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_structured_outputs_and_tool_calls_over_shm_with_a_decode_worker_killed(tmp_path):
    with _serve(tmp_path, "shm") as srv:
        srv.wait_ready(timeout=300)
        client = _client(srv)
        _check_fifty_schemas(client)
        _check_required_tool_calls(client)
        _check_named_and_round_trip(client)
        _check_migration(srv)


def test_structured_outputs_over_tcp(tmp_path):
    with _serve(tmp_path, "tcp") as srv:
        srv.wait_ready(timeout=300)
        _check_fifty_schemas(_client(srv))
