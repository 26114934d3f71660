"""Multi-head latent attention (DeepSeek-V2/V3) == transformers' own modules, on tiny random checkpoints.

Whole models go through save_pretrained and our Hugging Face directory loader, then run chunked
prefill (context expanded to per-head K/V) and decode steps (weight absorption) through a paged KV
cache that holds only the latent rows.
"""

from __future__ import annotations

import pytest
import torch
from paged_logits import paged_logits

from pdserve.cache.kv_cache import allocate_kv_cache, bytes_per_block, kv_shape
from pdserve.model.arch import TINY_CONFIGS, ModelArch
from pdserve.model.kernels.decode_attention import decode_attention_kernel
from pdserve.model.loader import build_model, default_gguf_path, load_gguf_tokenizer, load_hf_dir
from pdserve.model.mla import MLALayer

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
YARN_V3 = {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}

CASES = {
    "v2-lite": ("v2", dict(q_lora_rank=None)),
    "v2-qlora-yarn": ("v2", dict(q_lora_rank=24, rope_parameters=YARN)),
    "v3-yarn": ("v3", dict(q_lora_rank=24, rope_parameters=YARN_V3, n_group=4, topk_group=2)),
    "v3-no-qlora": ("v3", dict(q_lora_rank=None, n_group=1, topk_group=1)),
    "v3-plain-rope-order": (
        "v3",
        dict(q_lora_rank=24, rope_interleave=False, rope_parameters=YARN, n_group=2, topk_group=1),
    ),
}


def _hf_model(version: str, extra: dict):
    import transformers as tf

    cfg_cls, model_cls = (
        (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM)
        if version == "v2"
        else (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)
    )
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, **extra}))
    torch.manual_seed(1)
    with torch.no_grad():  # larger weights than HF's init, so that logits are not all near zero
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(20.0)
            elif "layernorm" in name:  # norms other than ones, so that each one is exercised
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval().float()


@pytest.mark.parametrize("case", list(CASES))
def test_mla_logits_match_hf(tmp_path, case):
    version, extra = CASES[case]
    hf = _hf_model(version, extra)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_hf_dir(tmp_path)
    a = loaded.arch
    assert a.is_mla and (a.kv_lora_rank, a.qk_rope_head_dim) == (32, 8)
    assert a.q_lora_rank == extra["q_lora_rank"]
    ours = build_model(loaded, "float32")
    assert all(isinstance(layer, MLALayer) for layer in ours.model.layers)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 1.0  # the check is not vacuous
    # Chunks of 16 with 8 decodes: a first chunk alone, later chunks over cached latents, decodes absorbed.
    got = paged_logits(ours, ids, chunk=16, decode=8, block=4)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    # Absorbed decodes without the native paged kernel (torch's products over gathered rows), and
    # decodes that expand their context instead of absorbing: the same logits.
    kernel = ours.model.layers[0].decode_kernel
    assert (kernel is None) == (
        decode_attention_kernel() is None
    )  # the native path ran above where it builds
    for layer in ours.model.layers:
        layer.decode_kernel = None
    torch.testing.assert_close(
        paged_logits(ours, ids, chunk=16, decode=8, block=4), ref, atol=2e-3, rtol=1e-3
    )
    for layer in ours.model.layers:
        layer.absorb, layer.decode_kernel = False, kernel
    torch.testing.assert_close(
        paged_logits(ours, ids, chunk=16, decode=8, block=4), ref, atol=2e-3, rtol=1e-3
    )


def test_yarn_changes_the_logits(tmp_path):
    """The control for the YaRN cases: the same weights without the scaling give other logits."""
    hf = _hf_model("v3", CASES["v3-yarn"][1])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_hf_dir(tmp_path)
    assert loaded.arch.rope_scaling and loaded.arch.rope_scaling["rope_type"] == "yarn"
    ids = list(range(3, 43))
    scaled = paged_logits(build_model(loaded, "float32"), ids, chunk=16, decode=4)
    loaded.arch.rope_scaling = None
    plain = paged_logits(build_model(loaded, "float32"), ids, chunk=16, decode=4)
    assert (scaled - plain).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v2-lite", "tiny-kimi"])
def test_kv_pool_holds_the_latent_only(name):
    """(kv_lora_rank + qk_rope_head_dim) x dtype size bytes per token per layer, in every dtype."""
    a = TINY_CONFIGS[name]
    per_token = a.kv_lora_rank + a.qk_rope_head_dim
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert bytes_per_block(a, 16, dtype) == a.num_layers * 16 * per_token * size
        kv = allocate_kv_cache(a, 3, 16, dtype)
        assert kv.shape == kv_shape(a, 3, 16) == (a.num_layers, 1, 48, 1, per_token)
        assert kv.numel() * kv.element_size() == 3 * bytes_per_block(a, 16, dtype)
    dense = ModelArch(num_layers=2, num_kv_heads=3, head_dim=64)  # the K/V layout is unchanged
    assert bytes_per_block(dense, 16, torch.float32) == 2 * 2 * 16 * 3 * 64 * 4


def test_mla_config_fields():
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,  # transformers writes qk_rope_head_dim here; a query head is nope + rope
        "n_routed_experts": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    a = ModelArch.from_hf_config(cfg)
    assert (a.kv_lora_rank, a.q_lora_rank, a.head_dim, a.rope_dim, a.v_head_dim) == (512, 1536, 192, 64, 128)
    assert a.rope_interleave and a.rope_scaling["rope_type"] == "yarn"
    assert a.kv_layout == (1, 1, 576)
    a = ModelArch.from_hf_config({**cfg, "q_lora_rank": None, "rope_interleave": False})
    assert a.q_lora_rank is None and not a.rope_interleave
    # Without kv_lora_rank a DeepSeek config keeps standard attention.
    a = ModelArch.from_hf_config({**cfg, "kv_lora_rank": None, "head_dim": 16})
    assert not a.is_mla and a.kv_layout == (2, 4, 16)


def test_long_chunk_after_cached_context_matches_hf(tmp_path):
    """Chunks of 300 tokens: the second attends to the first's cached latents, expanded, without a
    mask (chunk_attention.prefix_then_causal), the decodes that follow absorb."""
    hf = _hf_model("v3", {**CASES["v3-yarn"][1], "max_position_embeddings": 1024})
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(tmp_path / "tokenizer.json"))
    ours = build_model(load_hf_dir(tmp_path), "float32")
    ids = torch.randint(0, 512, (604,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = paged_logits(ours, ids, chunk=300, decode=4, block=16)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
