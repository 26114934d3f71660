"""The shape of a Llama-family decoder, read from a HF config.json, GGUF metadata or a built-in name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelArch:
    architecture: str = "llama"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False        # Qwen2: bias on q, k and v
    sliding_window: int | None = None   # Mistral v0.1; None means full attention
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArch":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = SUPPORTED_ARCHITECTURES.get(archs[0])
        if arch is None:
            raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id", 2)
        eos_list = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_list,
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    # transformers >= 5 writes rope_parameters (with rope_type "default" when unscaled).
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    return {**scaling, "rope_type": kind}


TINY_CONFIGS: dict[str, ModelArch] = {
    # Random weights for fast tests; they share the SmolLM2 tokenizer, hence its vocabulary.
    "tiny-llama": ModelArch(architecture="llama", hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                            max_position_embeddings=2048),
    "tiny-qwen2": ModelArch(architecture="qwen2", hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, attention_bias=True,
                            tie_word_embeddings=False, max_position_embeddings=2048),
    "tiny-mistral": ModelArch(architecture="mistral", hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=1, head_dim=16, tie_word_embeddings=False,
                              max_position_embeddings=2048),
}
