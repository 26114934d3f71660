"""vLLM's tokenizer endpoints on the router (POST /tokenize, POST /detokenize, GET /tokenizer_info):
answered by the router alone (no worker is registered here), with vLLM's shapes, the same ids as
the tokenizer and the chat template give, through the router's own tokenizer and through its pool
of tokenizer processes; bad input gets an OpenAI-style 400."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from api_errors import openai_error

from pdserve.common.tokenizer import load_tokenizer
from pdserve.config import load_config

MODEL = "tiny-qwen2"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
TEXT = "The capital of France is Paris."


def _calls(pool_processes: int, calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    from pdserve.router.gateway import create_router_app

    config = load_config(overrides={"model.name": MODEL, "router.encoder_workers": pool_processes})
    app = create_router_app(config)

    async def go() -> list[httpx.Response]:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c,
        ):
            return [await c.request(method, path, json=body) for method, path, body in calls]

    return asyncio.run(go())


@pytest.mark.parametrize("pool_processes", [0, 1], ids=["router-tokenizer", "tokenizer-pool"])
def test_tokenize_and_detokenize_give_the_tokenizers_ids(pool_processes):
    tok = load_tokenizer(MODEL)
    chat_ids = tok.encode_chat(MESSAGES)
    r = _calls(
        pool_processes,
        [
            ("POST", "/tokenize", {"model": MODEL, "prompt": TEXT}),
            ("POST", "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}),
            ("POST", "/tokenize", {"model": MODEL, "messages": MESSAGES}),
            ("POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}),
            ("POST", "/detokenize", {"model": MODEL, "tokens": chat_ids}),
            ("GET", "/tokenizer_info", None),
        ],
    )
    assert all(x.status_code == 200 for x in r), [x.text for x in r]
    plain, strs, chat, no_gen, detok, info = (x.json() for x in r)
    assert plain["tokens"] == tok.encode(TEXT) and plain["count"] == len(plain["tokens"])
    assert plain["token_strs"] is None and isinstance(plain["max_model_len"], int)  # 0 until a worker says
    assert strs["tokens"] == tok.encode(TEXT, add_special_tokens=False)
    assert strs["token_strs"] == [tok.id_to_token(i) for i in strs["tokens"]]
    assert chat["tokens"] == chat_ids
    assert no_gen["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES, False), add_special_tokens=False)
    assert len(no_gen["tokens"]) < len(chat_ids)
    assert detok["prompt"] == tok.decode(chat_ids, skip_special_tokens=False)
    assert tok.decode(plain["tokens"]) == TEXT
    assert info["vocab_size"] == tok.vocab_size and info["eos_token_ids"] == tok.eos_token_ids
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == plain["max_model_len"]


def test_bad_input_is_a_400_naming_the_field():
    r = _calls(
        0,
        [
            ("POST", "/tokenize", {"model": MODEL}),
            ("POST", "/tokenize", {"prompt": 5}),
            ("POST", "/detokenize", {"tokens": [1, 10**9]}),
            ("POST", "/detokenize", {"tokens": "abc"}),
            ("POST", "/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}),
            ("POST", "/tokenize", {"messages": MESSAGES, "continue_final_message": True}),
            ("POST", "/tokenize", {"model": "other-model", "prompt": TEXT}),
        ],
    )
    params = [openai_error(x, x.status_code)["param"] for x in r]
    assert [x.status_code for x in r[:6]] == [400] * 6, [x.text for x in r]
    assert params[:6] == ["prompt", "prompt", "tokens", "tokens", "chat_template", "continue_final_message"]
    assert r[6].status_code in (400, 404)


def test_tools_are_shown_as_a_chat_request_shows_them():
    from pdserve.server import tool_calls

    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    tok = load_tokenizer(MODEL)  # a ChatML template that renders no tools: they are described
    [r] = _calls(0, [("POST", "/tokenize", {"messages": MESSAGES, "tools": [tool]})])
    assert r.status_code == 200, r.text
    want = tok.encode_chat(
        [
            {
                "role": "system",
                "content": MESSAGES[0]["content"] + "\n\n" + tool_calls.describe_tools([tool]),
            },
            MESSAGES[1],
        ]
    )
    assert r.json()["tokens"] == want
    assert '"name": "weather"' in tok.decode(want)
