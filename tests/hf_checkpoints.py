"""Tiny random checkpoints written to disk as Hugging Face directories (config.json, safetensors in
two shards, the default model's tokenizer): a dense Llama, and MoE families in each one's names with
their experts in bf16 or FP8 block-scaled. Shared by the loader and digest tests. (pytest puts tests/
on the path.)"""

from __future__ import annotations

import json
import re

import torch
from safetensors.torch import save_file

from pdserve.model.arch import ModelArch
from pdserve.model.loader import default_gguf_path, load_gguf_tokenizer, tiny_random_weights

COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIGS = {
    "llama": {
        **COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
    },
    "qwen3_moe": {
        **COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 16,
        "norm_topk_prob": True,
    },
    "mixtral": {
        **COMMON,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    },
    # DeepSeek-V3: latent attention, a dense first layer, a shared expert, grouped sigmoid routing.
    "deepseek_v3": {
        **COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
}
BLOCK = (16, 32)  # FP8 blocks: several in each tiny matrix
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def to_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, scale_inv float32 per BLOCK) with w ~ q * scale_inv, as DeepSeek-V3 stores them."""
    (n, k), (bn, bk) = w.shape, BLOCK
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
    scale = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).flatten(2).flatten(0, 1)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


_STACK = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)$")


def _stored(name: str, t: torch.Tensor, fp8: bool) -> dict[str, torch.Tensor]:
    if not fp8:
        return {name: t.bfloat16()}
    if t.dim() == 2:
        q, s = to_fp8_blocks(t)
        return {name: q, name + "_scale_inv": s}
    parts = [to_fp8_blocks(x) for x in t]  # a fused 3-D stack: one grid of scales per expert
    return {name: torch.stack([q for q, _ in parts]), name + "_scale_inv": torch.stack([s for _, s in parts])}


def write_checkpoint(
    path, family: str, layout: str = "experts", fp8: bool = False, seed: int = 0, shards: int = 2
) -> ModelArch:
    """A random checkpoint of `family` in HF names: attention and dense layers in bf16, the experts in
    bf16 or FP8 with block scales, stored one by one (`experts`, in Mixtral's w1/w2/w3 for Mixtral)
    or as one 3-D tensor per layer and matrix (`fused`)."""
    cfg = dict(CONFIGS[family])
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    arch = ModelArch.from_hf_config(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in tiny_random_weights(arch, seed).items():
        m = _STACK.match(name)
        if m is None:
            if family == "mixtral":
                name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[name] = t.bfloat16()
            continue
        p = f"model.layers.{m[1]}.mlp.experts."
        if layout == "fused":
            out.update(_stored(p + f"{m[2]}_proj", t, fp8))
            continue
        for e, x in enumerate(t):
            halves = x.chunk(2) if m[2] == "gate_up" else (x,)
            names = ("gate_proj", "up_proj") if m[2] == "gate_up" else ("down_proj",)
            if family == "mixtral":
                p = f"model.layers.{m[1]}.block_sparse_moe.experts."
                names = ("w1", "w3") if m[2] == "gate_up" else ("w2",)
            for n, half in zip(names, halves):
                out.update(_stored(f"{p}{e}.{n}.weight", half, fp8))
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(path / "tokenizer.json"))
    names = sorted(out)  # in turn over the shards: a weight and its scale may lie in different files
    for i, part in enumerate(names[j::shards] for j in range(shards)):
        save_file({k: out[k].contiguous() for k in part}, str(path / f"model-{i}.safetensors"))
    return arch
