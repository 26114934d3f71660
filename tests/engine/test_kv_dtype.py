"""cache.kv_dtype bfloat16 under a float32 model: the pool holds half the bytes a token (twice the
tokens in the same budget), and greedy output is one thing across the paths that move or reuse the
KV: the mixed engine, a prefix-cache hit, and a prefill worker writing into a decode worker over
each transfer backend. MLA models are refused with the key named. `auto` resolves to bfloat16 under
quantized weights only, once for a whole PD deployment (from its decode role), and workers that hold
different dtypes refuse each other's transfers naming the key."""

from __future__ import annotations

import pytest
import torch
import yaml
from pd_harness import pd_config, pd_pair

from pdserve import SamplingParams
from pdserve.cache.kv_cache import bytes_per_block
from pdserve.config import load_config
from pdserve.config_rules import ConfigError
from pdserve.config_yaml import nest_dotted
from pdserve.deployment_plan import load_worker_config, pd_kv_dtype
from pdserve.engine.engine import LLMEngine
from pdserve.model.kv_dtype import resolve_kv_dtype

MODEL = "tiny-qwen2"  # greedy output depends on the KV (tiny-llama's does not)
BF16 = {"model.name": MODEL, "cache.kv_dtype": "bfloat16"}
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
PROMPTS = [
    torch.randint(3, 2000, (10 + 7 * i,), generator=torch.Generator().manual_seed(i)).tolist()
    for i in range(4)
]


def _run(engine: LLMEngine, tag: str) -> dict[int, tuple[list[int], list[float]]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", p, PARAMS)
    out: dict[int, tuple[list[int], list[float]]] = {}
    for o in engine.run_until_idle():
        toks, lps = out.setdefault(int(o.request_id[len(tag) :]), ([], []))
        toks += o.new_token_ids
        lps += [lp.logprob for lp in o.new_logprobs]
    return out


def test_a_bfloat16_pool_holds_twice_the_tokens():
    f32 = LLMEngine(load_config(None, {"model.name": MODEL, "cache.device_memory_gb": 0.01}))
    b16 = LLMEngine(load_config(None, {**BF16, "cache.device_memory_gb": 0.01}))
    try:
        assert f32.kv_cache.dtype == torch.float32 and b16.kv_cache.dtype == torch.bfloat16
        assert bytes_per_block(b16.arch, 16, torch.bfloat16) * 2 == bytes_per_block(
            f32.arch, 16, torch.float32
        )
        assert b16.pool.num_blocks in (
            2 * f32.pool.num_blocks,
            2 * f32.pool.num_blocks + 1,
        )  # budget // bytes
        a = b16.arch  # a token's keys and values in every layer: 2 bytes a value
        assert (
            b16.kv_cache[:, :, :1].numel() * b16.kv_cache.element_size()
            == a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2
        )
    finally:
        f32.close()
        b16.close()


def test_greedy_output_of_a_bfloat16_cache_is_one_across_hits_and_pd():
    mixed = LLMEngine(pd_config("mixed", overrides=BF16))
    try:
        want = _run(mixed, "a")
        again = _run(mixed, "b")  # every prompt's blocks but the last now hit the prefix cache
        assert mixed.stats()["prefix_cache_hit_tokens"] > 0
        assert mixed.pool.num_free == mixed.pool.num_blocks
    finally:
        mixed.close()
    # The same tokens; logprobs to rounding (a hit computes the prompt's last rows in other shapes, as
    # with a float32 cache).
    assert {i: t for i, (t, _) in again.items()} == {i: t for i, (t, _) in want.items()}
    for i in want:
        assert torch.allclose(torch.tensor(again[i][1]), torch.tensor(want[i][1]), rtol=0, atol=1e-4)
    # Rounding the KV moves the logprobs a little off the float32 cache's, never far.
    f32 = LLMEngine(pd_config("mixed", overrides={"model.name": MODEL}))
    try:
        full = _run(f32, "c")
    finally:
        f32.close()
    first = [abs(want[i][1][0] - full[i][1][0]) for i in want]
    assert 0 < max(first) < 0.05, first
    for backend in ("shm", "tcp"):
        with pd_pair(
            backend, prefill_config=pd_config("prefill", backend, overrides=BF16), decode_overrides=BF16
        ) as (prefill, decode):
            assert decode.engine.kv_cache.dtype == torch.bfloat16
            decode.run(PROMPTS, PARAMS)
            decode.wait_idle()
            prefill.wait_idle()
            assert not decode.errors, decode.errors
            assert {int(r[1:]): t for r, t in decode.outputs.items()} == {i: w[0] for i, w in want.items()}


def test_an_mla_model_refuses_a_kv_dtype_of_its_own():
    with pytest.raises(ConfigError, match="cache.kv_dtype"):
        LLMEngine(load_config(None, {"model.name": "tiny-deepseek-v3", "cache.kv_dtype": "bfloat16"}))


def _resolved(**keys) -> str:
    return resolve_kv_dtype(load_config(None, {k.replace("__", "."): v for k, v in keys.items()}))


def test_auto_is_bfloat16_under_quantized_float32_weights_only():
    assert _resolved() == "bfloat16"  # the default model: its Q4_1 file served as int4
    assert _resolved(model__quantization="none") == "float32"  # HF's float32 reference
    assert _resolved(model__name=MODEL) == "float32"  # a float checkpoint as stored
    assert _resolved(model__name=MODEL, model__quantization="int8") == "bfloat16"
    assert _resolved(model__name=MODEL, model__quantization="int4") == "bfloat16"
    assert _resolved(model__name=MODEL, model__dtype="bfloat16") == "bfloat16"  # the model's own
    assert _resolved(model__name=MODEL, model__quantization="int4", cache__kv_dtype="float32") == "float32"
    # MLA's latent cache and MoE models (at any expert-parallel size) keep the model's dtype.
    assert _resolved(model__name="tiny-deepseek-v3", model__quantization="int4") == "float32"
    for ep in (1, 2):
        mixtral = {"model__name": "tiny-mixtral", "model__quantization": "int4", "model__expert_parallel": ep}
        assert _resolved(**mixtral) == "float32"


def test_an_engine_over_int4_weights_holds_a_bfloat16_cache_by_default():
    engine = LLMEngine(pd_config("mixed", overrides={"model.quantization": "int4"}))
    try:
        assert engine.kv_cache.dtype == torch.bfloat16
    finally:
        engine.close()


def test_a_pd_deployment_resolves_auto_once_from_its_decode_role(tmp_path):
    roles = {"model.name": MODEL, "model.quantization": "none", "deployment.decode.quantization": "int4"}
    assert pd_kv_dtype(load_config(None, roles)) == "bfloat16"
    swapped = {**roles, "model.quantization": "int4", "deployment.decode.quantization": "none"}
    assert pd_kv_dtype(load_config(None, swapped)) == "float32"
    assert pd_kv_dtype(load_config(None, {**roles, "cache.kv_dtype": "float32"})) == "float32"
    # Each `pdserve worker --role R` reading the deployment's file: one dtype, its own quantization.
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(nest_dotted(roles)))
    prefill, deployment = load_worker_config(path, {}, "prefill")
    decode, _ = load_worker_config(path, {}, "decode")
    assert (prefill.model.quantization, decode.model.quantization) == ("none", "int4")
    assert prefill.cache.kv_dtype == decode.cache.kv_dtype == "bfloat16"
    assert deployment.cache.kv_dtype == "auto"  # the deployment's config (its version) is the file's
    # A worker's own flags win, its KV dtype included.
    flagged, _ = load_worker_config(path, {"cache.kv_dtype": "float32"}, "prefill")
    assert flagged.cache.kv_dtype == "float32"


def test_workers_holding_different_dtypes_refuse_each_others_transfers_naming_the_key():
    with pd_pair("shm", prefill_config=pd_config("prefill", "shm"), decode_overrides=BF16) as (
        prefill,
        decode,
    ):
        decode.run(PROMPTS[:1], PARAMS)
        decode.wait_idle()
        prefill.wait_idle()
        assert decode.finished == {"r0": "error"}
        assert "kv_elem_size" in decode.errors["r0"] and "cache.kv_dtype" in decode.errors["r0"]
