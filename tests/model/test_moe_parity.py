"""Our MoE models == HF transformers' own modules, on tiny random checkpoints.

Whole models (Mixtral, Qwen2-MoE, Qwen3-MoE, dots1 = Qwen3 attention + DeepSeek-V3 MoE) go through
save_pretrained and our Hugging Face directory loader, then run chunked prefill + decode through the
paged KV cache. DeepSeek-V2/V3 whole models (with MLA) are in test_mla_parity.py; their MoE blocks
are compared on their own here. A few greedy engine runs close the loop.
"""

from __future__ import annotations

import pytest
import torch
from paged_logits import paged_logits
from safetensors.torch import load_file, save_file

from pdserve.eplb.placement import LayerPlacement
from pdserve.model.arch import ModelArch
from pdserve.model.llama import DenseMLP
from pdserve.model.loader import build_model, default_gguf_path, load_gguf_tokenizer, load_hf_dir
from pdserve.model.moe import MoEBlock, canonical_moe_weights, expert_keys

BLOCK = 4
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _scaled(model):
    torch.manual_seed(1)
    with torch.no_grad():  # larger weights than HF's init, so logits and routing are not all near zero
        for name, p in model.named_parameters():
            p.mul_(20.0 if p.dim() > 1 else 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval().float()


def _hf_model(kind: str):
    import transformers as tf

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    cfgs = {
        "mixtral": (
            tf.MixtralConfig,
            tf.MixtralForCausalLM,
            dict(num_local_experts=16, num_experts_per_tok=2),
        ),
        "qwen2_moe": (
            tf.Qwen2MoeConfig,
            tf.Qwen2MoeForCausalLM,
            dict(
                num_experts=16,
                shared_expert_intermediate_size=48,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
                **moe,
            ),
        ),
        "qwen3_moe": (
            tf.Qwen3MoeConfig,
            tf.Qwen3MoeForCausalLM,
            dict(num_experts=16, norm_topk_prob=True, head_dim=16, **moe),
        ),
        "dots1": (
            tf.Dots1Config,
            tf.Dots1ForCausalLM,
            dict(
                n_routed_experts=16,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                sliding_window=None,
                **moe,
            ),
        ),
    }
    cfg_cls, model_cls, extra = cfgs[kind]
    torch.manual_seed(0)
    return _scaled(model_cls(cfg_cls(**COMMON, **extra)))


def _save(hf, path, rename=None):
    hf.save_pretrained(path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(path / "tokenizer.json"))
    if rename:
        for f in path.glob("*.safetensors"):
            save_file(
                {rename(k): v.contiguous() for k, v in load_file(str(f)).items()},
                str(f),
                metadata={"format": "pt"},
            )


def _check(path, hf, kind):
    loaded = load_hf_dir(path)
    assert loaded.arch.architecture == kind and loaded.arch.is_moe
    ours = build_model(loaded, "float32")
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = paged_logits(ours, ids, chunk=16, decode=5, block=BLOCK)
    assert ref.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    return ours


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "dots1"])
def test_moe_logits_match_hf(tmp_path, kind):
    hf = _hf_model(kind)
    _save(hf, tmp_path)
    ours = _check(tmp_path, hf, kind)
    if kind == "qwen2_moe":
        assert ours.model.moe_ids == [0, 2]  # mlp_only_layers=[1] is dense
    if kind == "dots1":
        assert ours.model.moe_ids == [1, 2]  # first_k_dense_replace=1
    assert ours.eplb.recorder.heatmap().sum() > 0  # the MoE layers feed the recorder


def test_mixtral_other_weight_naming(tmp_path):
    """Mixtral checkpoints name experts `block_sparse_moe.experts.N.w1/w2/w3` (what transformers
    writes) or `mlp.experts.N.gate_proj/up_proj/down_proj`: both load to the same model."""
    hf = _hf_model("mixtral")
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def rename(k: str) -> str:
        k = k.replace("block_sparse_moe.", "mlp.")
        for old, new in names.items():
            k = k.replace(f".{old}.weight", f".{new}.weight")
        return k

    _save(hf, tmp_path, rename)
    assert any(
        ".mlp.experts.3.up_proj.weight" in k for k in load_file(str(next(tmp_path.glob("*.safetensors"))))
    )
    _check(tmp_path, hf, "mixtral")


def test_expert_parallel_needs_a_moe_model():
    from pdserve import LLM

    with pytest.raises(ValueError, match="needs a MoE model"):
        LLM(model="tiny-llama", model__expert_parallel=2)


# ---------------------------------------------------------------- DeepSeek MoE blocks on their own

DS_CASES = [
    ("v2", {"topk_method": "greedy"}),
    ("v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    ("v3", {"n_group": 4, "topk_group": 2, "norm_topk_prob": True}),
    ("v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
]


@pytest.mark.parametrize(
    "version,extra",
    DS_CASES,
    ids=[f"{v}-{e.get('topk_method', 'groups' + str(e.get('n_group')))}" for v, e in DS_CASES],
)
def test_deepseek_moe_block_matches_hf(version, extra):
    import transformers as tf

    cfg_cls, moe_cls = (
        (tf.DeepseekV2Config, tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe)
        if version == "v2"
        else (tf.DeepseekV3Config, tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE)
    )
    kw = dict(
        hidden_size=64,
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=0,
        num_hidden_layers=1,
        num_attention_heads=4,
        **extra,
    )
    torch.manual_seed(0)
    ref = moe_cls(cfg_cls(**kw))
    with torch.no_grad():  # a bare module is not initialised the way a PreTrainedModel is
        for param in ref.parameters():
            param.normal_(0.0, 0.02)
    ref = _scaled(ref)
    arch = ModelArch.from_hf_config(
        {
            **kw,
            "architectures": [f"Deepseek{version.upper()}ForCausalLM"],
            "vocab_size": 8,
            "intermediate_size": 128,
            "kv_lora_rank": None,
        }
    )
    sd = {f"model.layers.0.mlp.{k}": v for k, v in ref.state_dict().items()}
    if version == "v2":  # transformers 5 keeps V2's experts fused in memory: its fused names load too
        assert expert_keys(0)[0].replace("gate_up", "gate_up_proj") in sd
    w = canonical_moe_weights(sd, arch)
    gate_up, down = (w[k] for k in expert_keys(0))
    p = "model.layers.0.mlp."
    shared = DenseMLP(*(w[p + f"shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")))
    block = MoEBlock(
        arch,
        0,
        w[p + "gate.weight"],
        w.get(p + "gate.e_score_correction_bias"),
        LayerPlacement.build(torch.arange(16), 16, 0, 16, gate_up, down),
        shared,
    )
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(x.unsqueeze(0))[0]
    torch.testing.assert_close(block(x), want, atol=1e-4, rtol=1e-4)
    assert want.abs().max() > 1.0


# ---------------------------------------------------------------- greedy engine runs


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-moe"])
def test_tiny_moe_generates(name):
    from pdserve import LLM, SamplingParams

    llm = LLM(model=name, threads=1, device_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(["The capital of France is", "def fib(n):"], params)
    assert [len(o.token_ids) for o in out] == [8, 8]
    assert llm.generate(["The capital of France is"], params)[0].token_ids == out[0].token_ids
    heat = llm.engine.model.eplb.to_dict()
    assert heat["layer_ids"] == llm.engine.arch.moe_layer_ids() and sum(heat["total"]) > 0
    llm.engine.close()
