"""A known OpenAI or vLLM field that pdserve does not implement gets a 400 naming it (code
unsupported_parameter), never a 200 that ignores it; the field at its no-op value, and fields no one
defines here, pass. The real router app (create_router_app) over ASGI in this process: a request that
passes validation gets the 503 of no decode worker instead."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from api_errors import openai_error

from pdserve.config import load_config
from pdserve.protocol import unsupported

MODEL = "tiny-qwen2"
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
COMPLETION = ("/v1/completions", {"prompt": "hi", "max_tokens": 4})
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}

# One value that asks for the feature, per refused field.
ASKS = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    "structured_outputs": {"json": SCHEMA},
    "guided_json": SCHEMA,
    "guided_regex": "[0-9]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= 'a'",
    "structural_tag": {"type": "x"},
    "logit_bias": {"11": 5},
    "prompt_logprobs": 1,
    "allowed_token_ids": [11, 12],
    "bad_words": ["x"],
    "logits_processors": ["p"],
    "min_tokens": 3,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "best_of": 3,
    "truncate_prompt_tokens": 8,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "return_tokens_as_token_ids": True,
    "priority": 5,
    "kv_transfer_params": {"do_remote_decode": True},
    "reasoning_effort": "high",
    "tools": [TOOL],
    "tool_choice": "required",
    "functions": [TOOL["function"]],
    "function_call": {"name": "f"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"content": "x"},
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "add_generation_prompt": False,
    "continue_final_message": True,
    "documents": [{"text": "d"}],
    "mm_processor_kwargs": {"x": 1},
    "web_search_options": {"search_context_size": "low"},
    "echo": True,
    "suffix": "tail",
    "add_special_tokens": False,
}
CASES = [(CHAT, f) for f in {**unsupported.COMMON, **unsupported.CHAT}] + [
    (COMPLETION, f) for f in {**unsupported.COMMON, **unsupported.COMPLETION}
]


def _post(path: str, body: dict) -> httpx.Response:
    from pdserve.router.gateway import create_router_app

    app = create_router_app(load_config(overrides={"model.name": MODEL, "router.encoder_workers": 0}))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            return await c.post(path, json={"model": MODEL, **body})

    return asyncio.run(go())


def test_every_refused_field_has_a_case():
    assert set(ASKS) >= set(unsupported.COMMON) | set(unsupported.CHAT) | set(unsupported.COMPLETION)


@pytest.mark.parametrize("endpoint, field", CASES, ids=[f"{e[0].split('/')[-1]}-{f}" for e, f in CASES])
def test_a_field_not_implemented_is_a_400_naming_it(endpoint, field):
    path, body = endpoint
    err = openai_error(_post(path, {**body, field: ASKS[field]}), 400)
    assert err["param"] == field and err["code"] == "unsupported_parameter", err
    assert field in err["message"]


def test_echo_with_logprobs_and_prompt_logprobs_are_taken():
    path, body = COMPLETION
    for extra in ({"echo": True, "logprobs": 1}, {"prompt_logprobs": 2}):
        assert openai_error(_post(path, {**body, **extra}), 503)["code"] == "no_workers"
    err = openai_error(_post(path, {**body, "prompt_logprobs": 2, "stream": True}), 400)
    assert err["param"] == "prompt_logprobs"


@pytest.mark.parametrize(
    "endpoint, extra",
    [
        (
            CHAT,
            {
                "response_format": {"type": "text"},
                "tools": [],
                "tool_choice": "none",
                "logit_bias": {},
                "parallel_tool_calls": True,
                "modalities": ["text"],
                "add_generation_prompt": True,
                "priority": 0,
                "skip_special_tokens": True,
                "best_of": 1,
                "min_tokens": 0,
                "echo": False,
            },
        ),
        (CHAT, {"tool_choice": "auto", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}),
        (
            COMPLETION,
            {
                "echo": True,
                "suffix": None,
                "length_penalty": 1.0,
                "add_special_tokens": True,
                "some_vendor_field": {"x": 1},
            },
        ),
    ],
)
def test_no_op_values_and_unknown_fields_pass(endpoint, extra):
    path, body = endpoint
    assert openai_error(_post(path, {**body, **extra}), 503)["code"] == "no_workers"
