"""Reasoning content and chat_template_kwargs through the real router:
- `pdserve serve --mode mixed --reasoning-parser deepseek_r1` (real processes, the official openai
  client): the answer's text splits at its first </think> into reasoning_content and content, the
  same text as the offline engine's, and the streamed deltas add up to the same two texts;
- chat_template_kwargs reach the chat template (a model directory whose template reads
  enable_thinking), in /tokenize and in a chat request's prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.config import load_config

MODEL = "tiny-qwen2"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


def _expected(text: str) -> tuple[str | None, str]:
    # deepseek_r1, written out again: reasoning from the start (a leading <think> dropped) to the
    # first </think>; the answer after it; no </think>: all reasoning.
    body = text.lstrip()
    body = body[len("<think>") :] if body.startswith("<think>") else text
    thought, tag, answer = body.partition("</think>")
    return (thought or None, answer) if tag else (body or None, "")


@pytest.mark.slow
def test_reasoning_content_through_the_router(tmp_path):
    params = SamplingParams(temperature=0, max_tokens=24)
    text = LLM(model=MODEL).chat([MESSAGES], params)[0].text
    want = _expected(text)
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--mode",
        "mixed",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--reasoning-parser",
        "deepseek_r1",
    ]
    with ServerProcess(cmd, port, tmp_path / "serve.log") as srv:
        srv.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        msg = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
        got = msg.choices[0].message
        assert (got.model_extra.get("reasoning_content"), got.content) == want
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stream=True
        ):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
        assert (reasoning or None, content) == want


def test_chat_template_kwargs_reach_the_template(tmp_path):
    from pdserve.common.tokenizer import default_gguf_path, load_gguf_tokenizer
    from pdserve.router.gateway import create_router_app

    model = tmp_path / "model"
    model.mkdir()
    base = load_gguf_tokenizer(str(default_gguf_path()))
    base.tok.save(str(model / "tokenizer.json"))
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 2}))
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
        " <think></think>{% endif %}{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    app = create_router_app(load_config(overrides={"model.name": str(model), "router.encoder_workers": 0}))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            plain = await c.post("/tokenize", json={"messages": MESSAGES})
            off = await c.post(
                "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
            )
            chat = await c.post(
                "/v1/chat/completions",
                json={
                    "model": str(model),
                    "messages": MESSAGES,
                    "chat_template_kwargs": {"enable_thinking": False},
                },
            )
            return plain, off, chat

    plain, off, chat = asyncio.run(go())
    want = base.encode("user: Why is the sky blue?\nassistant:", add_special_tokens=False)
    assert plain.json()["tokens"] == want
    assert off.json()["tokens"] == base.encode(
        "user: Why is the sky blue?\nassistant: <think></think>", add_special_tokens=False
    )
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "no_workers"  # templated, then routed
