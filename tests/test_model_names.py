"""Model names as users write them (common/model_names.py, server.served_model_name):
- a Hugging Face repository id loads, offline, from its snapshot in the local Hugging Face cache
  (a cache laid out here, as huggingface_hub lays it out), with the same outputs as its directory;
- the packaged default answers to its repository's id when the cache does not hold it;
- an id found nowhere is an error naming the cache it looked in (nothing is downloaded);
- the served model names are aliases: /v1/models lists each, a request may name any, the first
  names the model in responses, and another name is a 400."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from api_errors import openai_error

from pdserve import LLM, SamplingParams
from pdserve.common.model_names import DEFAULT_REPO, resolve_model
from pdserve.common.tokenizer import DEFAULT_MODEL, default_gguf_path, load_gguf_tokenizer, load_tokenizer
from pdserve.config import load_config, served_names


def _hf_cache(root, repo: str, revision: str = "0123abcd"):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=load_gguf_tokenizer(str(default_gguf_path())).vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    snap = root / f"models--{repo.replace('/', '--')}" / "snapshots" / revision
    tf.LlamaForCausalLM(cfg).save_pretrained(snap, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(snap / "tokenizer.json"))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(revision)
    return snap


def test_a_repository_id_loads_from_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snap = _hf_cache(tmp_path, "acme/tiny-llama-chat")
    assert resolve_model("acme/tiny-llama-chat") == str(snap)
    params = SamplingParams(temperature=0, max_tokens=6)
    by_id = LLM(model="acme/tiny-llama-chat").generate(["The sky is"], params)[0]
    by_dir = LLM(model=str(snap)).generate(["The sky is"], params)[0]
    assert by_id.token_ids == by_dir.token_ids and len(by_id.token_ids) == 6
    assert load_tokenizer("acme/tiny-llama-chat").encode("hi") == load_tokenizer(str(snap)).encode("hi")


def test_the_default_answers_to_its_repository_id_and_unknown_ids_say_where_they_were_looked_for(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert resolve_model(DEFAULT_REPO) == DEFAULT_MODEL
    assert resolve_model("tiny-qwen2") == "tiny-qwen2" and resolve_model("no-slash") == "no-slash"
    with pytest.raises(ValueError, match=f"not in the Hugging Face cache at {tmp_path}"):
        LLM(model="acme/absent-model")


def test_served_model_names_are_aliases():
    from pdserve.router.gateway import create_router_app

    config = load_config(
        overrides={
            "model.name": "tiny-qwen2",
            "router.encoder_workers": 0,
            "server.served_model_name": "acme/chat, chat",
        }
    )
    assert served_names(config) == ["acme/chat", "chat"]
    assert served_names(load_config(overrides={"model.name": "tiny-qwen2"})) == ["tiny-qwen2"]
    app = create_router_app(config)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            body = {"prompt": "hi", "max_tokens": 2}
            return (
                await c.get("/v1/models"),
                [
                    await c.post("/v1/completions", json={**body, "model": m})
                    for m in ("acme/chat", "chat", "tiny-qwen2")
                ],
            )

    models, (first, alias, other) = asyncio.run(go())
    assert [m["id"] for m in models.json()["data"]] == ["acme/chat", "chat"]
    assert (
        openai_error(first, 503)["code"] == "no_workers" and openai_error(alias, 503)["code"] == "no_workers"
    )
    err = openai_error(other, 400)
    assert err["code"] == "model_not_found" and "'acme/chat', 'chat'" in err["message"]
