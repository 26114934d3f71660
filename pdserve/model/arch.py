"""The shape of a Llama-family decoder (dense or MoE), read from a HF config.json, GGUF metadata or a
built-in name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    # Mixture-of-experts models (see moe.py). DeepSeek-V2/V3 (and V3-shaped R1, Kimi-K2) with
    # multi-head latent attention (mla.py) when the config sets kv_lora_rank, else standard attention.
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Dots1ForCausalLM": "dots1",  # Qwen3 attention + DeepSeek-V3 MoE: the HF reference for the latter
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
    attention_bias: bool = False  # Qwen2: bias on q, k and v
    sliding_window: int | None = None  # Mistral v0.1; None means full attention
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    qk_norm: bool = False  # Qwen3-MoE, dots1: RMSNorm of each q and k head before RoPE
    # Mixture of experts; num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    moe_layers: list[int] | None = None  # layers with a MoE block; None: all of them
    scoring_func: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy (V2) | noaux_tc (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE gates its shared expert with a sigmoid
    # Multi-head latent attention (DeepSeek-V2/V3, mla.py) when kv_lora_rank > 0: the KV cache holds a
    # compressed latent of kv_lora_rank values plus one shared rope key of qk_rope_head_dim per token.
    # head_dim is then qk_nope_head_dim + qk_rope_head_dim (a query head) and num_kv_heads == num_heads.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: queries come from q_proj directly (V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = (
        False  # rope dims in (x0, x1), (x2, x3) pairs, as DeepSeek's checkpoints store them
    )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer_ids(self) -> list[int]:
        if not self.is_moe:
            return []
        return list(range(self.num_layers)) if self.moe_layers is None else list(self.moe_layers)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions the rotary embedding turns (MLA: the rope part of a head only)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(planes, heads, values) of one token of one layer in the KV pool: K and V planes of
        num_kv_heads x head_dim, or with MLA one plane of one latent row (latent, then rope key)."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def kv_layout_name(self) -> str:
        """The KV layout in words, for the compatibility check of two workers' pools."""
        if self.is_mla:
            return f"mla latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}"
        return f"k,v {self.num_kv_heads} x {self.head_dim}"

    def kv_cache_shape(self, slots: int) -> tuple[int, ...]:
        planes, heads, dim = self.kv_layout
        return (self.num_layers, planes, slots, heads, dim)

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
            raise ValueError(
                f"unsupported architecture {archs[0]!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id", 2)
        eos_list = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        window = (
            cfg.get("sliding_window")
            if cfg.get("use_sliding_window", arch in ("mistral", "mixtral"))
            else None
        )
        mla = _mla_fields(cfg, arch)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads if mla else cfg.get("num_key_value_heads") or heads,
            head_dim=mla.get("qk_nope_head_dim", 0) + mla.get("qk_rope_head_dim", 0)
            or cfg.get("head_dim")
            or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("qwen2", "qwen2_moe"))),
            sliding_window=window or None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_list,
            qk_norm=arch in ("qwen3_moe", "dots1"),
            **_moe_fields(cfg, arch),
            **mla,
        )


def _mla_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Multi-head latent attention's shape, for DeepSeek-V2/V3 configs that set kv_lora_rank."""
    if arch not in ("deepseek_v2", "deepseek_v3") or not cfg.get("kv_lora_rank"):
        return {}
    out = {
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "q_lora_rank": int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        "qk_nope_head_dim": int(cfg.get("qk_nope_head_dim", 128)),
        "qk_rope_head_dim": int(cfg.get("qk_rope_head_dim", 64)),
        "v_head_dim": int(cfg.get("v_head_dim") or 128),
        # V2 always pairs its rope dims (complex rotation); V3's config says (transformers' default True).
        "rope_interleave": True if arch == "deepseek_v2" else bool(cfg.get("rope_interleave", True)),
    }
    if out["qk_rope_head_dim"] % 2 or out["qk_rope_head_dim"] <= 0:
        raise ValueError(f"qk_rope_head_dim must be a positive even number, got {out['qk_rope_head_dim']}")
    return out


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE part of a HF config, in each family's own keys."""
    if arch in ("llama", "mistral", "qwen2"):
        return {}
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    layers = cfg["num_hidden_layers"]
    out: dict[str, Any] = dict(
        num_experts=n,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
    )
    if arch == "mixtral":
        return out
    if arch in ("qwen2_moe", "qwen3_moe"):
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        out["moe_layers"] = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        out["norm_topk_prob"] = cfg.get("norm_topk_prob", arch == "qwen3_moe")
        if arch == "qwen2_moe":
            out["shared_expert_intermediate_size"] = cfg.get("shared_expert_intermediate_size", 0)
            out["shared_expert_gate"] = out["shared_expert_intermediate_size"] > 0
        return out
    # DeepSeek-V2/V3 and dots1: the first k layers dense, then a MoE every moe_layer_freq layers.
    first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    v2 = arch == "deepseek_v2"
    out.update(
        moe_layers=[i for i in range(layers) if i >= first and i % freq == 0],
        scoring_func=cfg.get("scoring_func", "softmax" if v2 else "sigmoid"),
        topk_method=cfg.get("topk_method", "greedy" if v2 else "noaux_tc"),
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        # HF's DeepseekV2 never renormalises the top-k weights; V3 and dots1 read the flag.
        norm_topk_prob=False if v2 else cfg.get("norm_topk_prob", False),
        routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
        shared_expert_intermediate_size=(cfg.get("n_shared_experts") or 0) * out["moe_intermediate_size"],
    )
    return out


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
    "tiny-llama": ModelArch(
        architecture="llama",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    ),
    "tiny-qwen2": ModelArch(
        architecture="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
    "tiny-mistral": ModelArch(
        architecture="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
    # MoE: 16 experts, top-2, one shared expert where the family has them.
    "tiny-mixtral": ModelArch(
        architecture="mixtral",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        num_experts=16,
        moe_intermediate_size=64,
    ),
    "tiny-qwen2-moe": ModelArch(
        architecture="qwen2_moe",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        num_experts=16,
        moe_intermediate_size=64,
        norm_topk_prob=False,
        shared_expert_intermediate_size=128,
        shared_expert_gate=True,
    ),
    "tiny-qwen3-moe": ModelArch(
        architecture="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        qk_norm=True,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        num_experts=16,
        moe_intermediate_size=64,
    ),
    # DeepSeek-V3 routing (sigmoid, 4 groups of which 2 are kept, correction bias) on standard attention.
    "tiny-deepseek-moe": ModelArch(
        architecture="deepseek_v3",
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        num_experts=16,
        moe_intermediate_size=64,
        moe_layers=[1, 2],
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        shared_expert_intermediate_size=64,
    ),
    # Multi-head latent attention (mla.py) on DeepSeek's MoE, shaped as each family's real config is,
    # scaled down: V3 with a query low-rank, interleaved rope pairs and YaRN (mscale 1); V2-Lite with
    # q_proj and YaRN mscale 0.707; Kimi-K2 is V3-shaped, one expert group, more experts, another YaRN.
    "tiny-deepseek-v3": ModelArch(
        architecture="deepseek_v3",
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        num_experts=16,
        moe_intermediate_size=64,
        moe_layers=[1, 2],
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        shared_expert_intermediate_size=64,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
    ),
    "tiny-deepseek-v2-lite": ModelArch(
        architecture="deepseek_v2",
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        moe_layers=[1, 2],
        scoring_func="softmax",
        topk_method="greedy",
        norm_topk_prob=False,
        shared_expert_intermediate_size=64,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
    ),
    "tiny-kimi": ModelArch(
        architecture="deepseek_v3",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=8,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 1,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        moe_layers=[1],
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        shared_expert_intermediate_size=32,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
    ),
}


# Vision-language models (model/vlm.py): LLaVA's config.json nests the decoder's in text_config.
_TEXT_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TINY_VLMS = {"tiny-llava": "tiny-qwen2"}  # built-in tiny VLM -> the tiny decoder it uses


def is_llava_config(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "llava" or "LlavaForConditionalGeneration" in (
        cfg.get("architectures") or []
    )


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config.json, as ModelArch.from_hf_config reads a text model's."""
    tc = dict(cfg.get("text_config") or {})
    tc.setdefault("architectures", [_TEXT_ARCHS.get(tc.get("model_type", "llama"), "LlamaForCausalLM")])
    tc.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return tc
