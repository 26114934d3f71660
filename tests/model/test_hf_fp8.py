"""Hugging Face directories read tensor by tensor: FP8 block-scaled checkpoints (DeepSeek-V3's
`weight_scale_inv` form) give the model of their dequantized copy, bf16 ones the model of their
float32 copy; with model.quantization the FP8 weights are quantized as the dequantized ones are."""

from __future__ import annotations

import json

import pytest
import torch
from paged_logits import paged_logits
from safetensors.torch import save_file

from pdserve.config import ModelConfig
from pdserve.model import hf_files
from pdserve.model.arch import ModelArch
from pdserve.model.hf_files import HFWeights, dequantize_fp8, read_weights
from pdserve.model.loader import (
    build_model,
    default_gguf_path,
    load_gguf_tokenizer,
    load_hf_dir,
    tiny_random_weights,
)

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# Neither dimension a multiple of 128 (hidden 160, intermediate 288): every matrix has partial edge
# blocks; int4 still fits (K a multiple of 32, fused rows of 16).
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 160,
    "intermediate_size": 288,
    "num_hidden_layers": 2,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def to_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, scale_inv float32 per block) with w ~ q * scale_inv, as DeepSeek-V3 stores them."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = w
    blocks = padded.view(gn, bn, gk, bk)
    scale = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gn * bn, gk * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


def dequantized_f64(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    s = scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.double() * s


def _write(path, weights: dict[str, torch.Tensor], quantization_config: dict | None = None) -> None:
    path.mkdir()
    cfg = dict(CONFIG, quantization_config=quantization_config) if quantization_config else CONFIG
    (path / "config.json").write_text(json.dumps(cfg))
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(path / "tokenizer.json"))
    # Two shards, so that a weight and its scale may be read from different files.
    names = sorted(weights)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({k: weights[k].contiguous() for k in part}, str(path / f"model-{i}.safetensors"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(FP8 directory, its dequantized copy in float32, the dequantized weights in float64)."""
    root = tmp_path_factory.mktemp("fp8")
    w = {k: v * 8 for k, v in tiny_random_weights(ModelArch.from_hf_config(CONFIG), seed=3).items()}
    block = tuple(FP8_CONFIG["weight_block_size"])
    fp8, copy, ref = {}, {}, {}
    for name, t in w.items():
        if name.endswith("_proj.weight"):  # the linear layers, as DeepSeek quantizes them
            q, s = to_fp8_blocks(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = dequantized_f64(q, s, block)
            copy[name] = ref[name].float()
        else:
            fp8[name] = copy[name] = t.bfloat16()
    _write(root / "fp8", fp8, FP8_CONFIG)
    _write(root / "copy", copy)
    return root / "fp8", root / "copy", ref


def _logits(path, dtype: str = "float32", quantization: str = "none"):
    model = build_model(load_hf_dir(path), dtype, model_config=ModelConfig(quantization=quantization))
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, paged_logits(model, ids, chunk=8, decode=4)


@pytest.mark.parametrize(
    "shape,block",
    [((300, 200), (128, 128)), ((128, 256), (128, 128)), ((5, 7), (128, 128)), ((257, 129), (16, 32))],
)
def test_dequantize_fp8_is_one_rounding_of_the_float64_product(monkeypatch, shape, block):
    # Passes of 128 rows or fewer, so that the larger shapes go through several.
    monkeypatch.setattr(hf_files, "_CHUNK", 128 * 200)
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3
    q, s = to_fp8_blocks(w, block)
    ref = dequantized_f64(q, s, block)
    got = dequantize_fp8(q, s, block)
    assert got.dtype == torch.float32 and got.shape == shape
    # An FP8 value has 4 significant bits and the scale 24: their float32 product is one rounding of
    # the exact (float64) one, within half an ulp.
    assert torch.all((got.double() - ref).abs() <= ref.abs() * 2.0**-24)
    assert torch.equal(dequantize_fp8(q, s, block, torch.bfloat16), ref.float().bfloat16())
    assert (ref - w.double()).abs().max() > 0  # FP8 did round: the scales matter


def test_fp8_checkpoint_gives_the_logits_of_its_dequantized_copy(checkpoints):
    fp8_dir, copy_dir, ref = checkpoints
    weights = load_hf_dir(fp8_dir).weights
    assert isinstance(weights, HFWeights)
    assert not any(k.endswith("_scale_inv") for k in weights)  # scales come with their weight
    for name, r in ref.items():
        assert weights.stored(name).dtype == torch.float8_e4m3fn
        got = weights[name]
        assert got.dtype == torch.float32 and torch.all((got.double() - r).abs() <= r.abs() * 2.0**-24)
    _, got = _logits(fp8_dir)
    _, want = _logits(copy_dir)
    assert want.abs().max() > 1.0  # the check is not vacuous
    # The dequantized weights are the float64 ones rounded once, as the copy's are: the same float32
    # weights through the same code, so the same logits.
    assert torch.equal(got, want), (got - want).abs().max()
    # In bfloat16, each weight rounded once more from those float32 values, as the copy's are.
    a = build_model(load_hf_dir(fp8_dir), "bfloat16")
    b = build_model(load_hf_dir(copy_dir), "bfloat16")
    for x, y in zip(a.layers, b.layers, strict=True):
        for u, v in ((x.qkv, y.qkv), (x.o, y.o), (x.mlp.gate_up, y.mlp.gate_up), (x.mlp.down, y.mlp.down)):
            assert u.dtype == torch.bfloat16 and torch.equal(u, v)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fp8_requantized_agrees_with_quantizing_the_dequantized_weights(checkpoints, mode):
    fp8_dir, copy_dir, _ = checkpoints
    model, got = _logits(fp8_dir, quantization=mode)
    direct, want = _logits(copy_dir, quantization=mode)
    for a, b in zip(model.layers, direct.layers, strict=True):
        for x, y in ((a.qkv, b.qkv), (a.o, b.o), (a.mlp.gate_up, b.mlp.gate_up), (a.mlp.down, b.mlp.down)):
            assert getattr(x, "mode", None) == mode
            assert torch.equal(x.dequantize(), y.dequantize())
    assert torch.equal(got, want)
    _, dense = _logits(fp8_dir)
    assert not torch.equal(got, dense)  # quantized for real


def test_bf16_checkpoint_reads_in_its_stored_dtype(tmp_path):
    w = tiny_random_weights(ModelArch.from_hf_config(CONFIG), seed=4)
    _write(tmp_path / "bf16", {k: v.bfloat16() for k, v in w.items()})
    _write(tmp_path / "f32", {k: v.bfloat16().float() for k, v in w.items()})
    weights = load_hf_dir(tmp_path / "bf16").weights
    assert isinstance(weights, HFWeights) and set(weights) == set(w)
    name = "model.layers.0.mlp.down_proj.weight"
    assert weights[name].dtype == torch.bfloat16
    assert weights.converted(torch.float32)[name].dtype == torch.float32
    assert read_weights(tmp_path / "bf16")[name].dtype == torch.bfloat16
    assert weights.stored_nbytes == sum(v.numel() * 2 for v in w.values())
    for mode in ("none", "int8"):
        _, got = _logits(tmp_path / "bf16", quantization=mode)
        _, want = _logits(tmp_path / "f32", quantization=mode)
        assert torch.equal(got, want)  # bf16 -> float32 is exact: the same model


def test_malformed_fp8_checkpoints_are_refused(tmp_path):
    q, s = to_fp8_blocks(torch.randn(160, 160), (128, 128))
    _write(tmp_path / "noscale", {"a.weight": q})
    with pytest.raises(ValueError, match="a.weight_scale_inv"):
        HFWeights.open(tmp_path / "noscale")
    _write(
        tmp_path / "block",
        {"a.weight": q, "a.weight_scale_inv": s},
        dict(FP8_CONFIG, weight_block_size=[64, 64]),
    )
    with pytest.raises(ValueError, match="do not tile"):
        HFWeights.open(tmp_path / "block")["a.weight"]
    f = tmp_path / "block" / "model-0.safetensors"
    f.write_bytes(f.read_bytes()[:-1])  # a file cut short: its header's offsets run past its end
    with pytest.raises(ValueError, match="do not fit"):
        HFWeights.open(tmp_path / "block")
    _write(tmp_path / "gptq", {"a.weight": torch.zeros(2, 2)}, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        load_hf_dir(tmp_path / "gptq")


def test_fp8_deepseek_v3_checkpoint_gives_the_logits_of_its_dequantized_copy(tmp_path):
    """DeepSeek-V3's own layout: latent attention's projections and every expert FP8 (per expert, 2-D),
    the router and embeddings not; blocks of 16 x 32 so that tiny matrices hold several, partial ones
    included. The MoE model reads the whole directory up front, as stored."""
    import transformers as tf
    from safetensors.torch import load_file

    cfg = tf.DeepseekV3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = tf.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than HF's init, so that logits are not all near zero
        for p in hf.parameters():
            p.mul_(20.0 if p.dim() > 1 else 1.0)
    hf.save_pretrained(tmp_path / "src")
    block = (16, 32)
    fp8, copy = {}, {}
    for f in (tmp_path / "src").glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            if t.dim() == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
                q, s = to_fp8_blocks(t.float(), block)
                fp8[name], fp8[name + "_scale_inv"] = q, s
                copy[name] = dequantized_f64(q, s, block).float()
            else:
                fp8[name] = copy[name] = t
    assert any(".mlp.experts." in k and k.endswith("_scale_inv") for k in fp8)
    src_cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    for name, weights, qc in (
        ("fp8", fp8, dict(FP8_CONFIG, weight_block_size=list(block))),
        ("copy", copy, None),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(src_cfg, quantization_config=qc) if qc else src_cfg))
        load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(d / "tokenizer.json"))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
    loaded = load_hf_dir(tmp_path / "fp8")
    assert loaded.arch.is_mla and loaded.arch.is_moe
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    got = paged_logits(build_model(loaded, "float32"), ids, chunk=8, decode=4)
    want = paged_logits(build_model(load_hf_dir(tmp_path / "copy"), "float32"), ids, chunk=8, decode=4)
    assert want.abs().max() > 1.0  # the check is not vacuous
    assert torch.equal(got, want), (got - want).abs().max()  # the same float32 weights, as above
