"""Logits of our model == HF transformers' on tiny random Llama / Qwen2 / Mistral checkpoints.

The checkpoint goes through our Hugging Face directory loader, and our side runs the prompt in
chunks through the paged KV cache, then decodes a few tokens, so that every path is covered.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from paged_logits import paged_logits

from pdserve.model.loader import build_model, default_gguf_path, load_gguf, load_gguf_tokenizer, load_hf_dir

BLOCK = 4


def _hf_model(kind: str, vocab_size: int = 512, **extra):
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **extra,
    )
    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = cls[1](cls[0](**common))
    with torch.no_grad():  # larger weights than HF's init, so logits are not all near zero
        for p in model.parameters():
            p.mul_(20.0 if p.dim() > 1 else 1.0)
    return model.eval().float()


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}


CASES = [
    ("llama", {}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    ("llama", {"rope_parameters": LLAMA3}),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            }
        },
    ),
    ("qwen2", {}),
    ("mistral", {"sliding_window": 8}),
]


@pytest.mark.parametrize(
    "kind,extra",
    CASES,
    ids=[
        f"{k}-{e.get('rope_parameters', {}).get('rope_type', '')}{e.get('sliding_window', '')}"
        for k, e in CASES
    ],
)
def test_logits_match_hf(tmp_path, kind, extra):
    hf = _hf_model(kind, **extra)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_hf_dir(tmp_path)
    assert loaded.arch.architecture == kind
    ours = build_model(loaded, "float32")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (40,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = paged_logits(ours, ids, chunk=16, decode=5, block=BLOCK)
    assert ref.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)


def _rope_freqs(head_dim: int, p: dict) -> np.ndarray:
    """The factors llama.cpp's convert_hf_to_gguf.py stores as rope_freqs for a llama3 scaling (its
    float32 arithmetic): 1 for short wavelengths, `factor` for long ones, smoothed between."""
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    orig, low, high = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(p["factor"])
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def _write_llama_gguf(hf, path, rope_freqs: np.ndarray | None) -> None:
    """`hf` as llama.cpp's converter lays a Llama out (float32 tensors, attn_q/attn_k rows permuted
    per head), with the packaged model's tokenizer."""
    import gguf

    from pdserve.common.gguf_file import GGUFFile

    tok = GGUFFile(default_gguf_path()).fields
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(LLAMA3["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    tensors = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    names |= {f"self_attn.{p}_proj": f"attn_{g}" for p, g in zip("qkvo", ["q", "k", "v", "output"])}
    names |= {f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")}
    for i in range(c.num_hidden_layers):
        for hf_name, g in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g in ("attn_q", "attn_k"):
                t = permute(t, c.num_attention_heads if g == "attn_q" else c.num_key_value_heads)
            tensors[f"blk.{i}.{g}.weight"] = t
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = torch.from_numpy(rope_freqs)
    for name, t in tensors.items():
        w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_with_rope_freqs_gives_the_llama3_logits(tmp_path):
    """llama.cpp's converter stores Llama 3.x's rope scaling as a rope_freqs tensor and no scaling type:
    a GGUF of an HF Llama with llama3 scaling must give that model's logits, and without its
    rope_freqs tensor it must not (so the check can fail)."""
    vocab = len(load_gguf_tokenizer(str(default_gguf_path())).tok.get_vocab())
    hf = _hf_model("llama", rope_parameters=LLAMA3, vocab_size=vocab)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (40,), generator=g).tolist()
    with torch.no_grad():
        ref = hf.double()(torch.tensor([ids])).logits[0].float()  # float64: the same on every CPU
    got = {}
    for case, freqs in (("freqs", _rope_freqs(16, LLAMA3)), ("none", None)):
        path = tmp_path / f"{case}.gguf"
        _write_llama_gguf(hf, path, freqs)
        loaded = load_gguf(path)
        assert (loaded.arch.rope_scaling or {}).get("rope_type") == (
            "freq_factors" if freqs is not None else None
        )
        got[case] = paged_logits(build_model(loaded, "float32"), ids, chunk=16, decode=5, block=BLOCK)
    torch.testing.assert_close(got["freqs"], ref, atol=2e-3, rtol=1e-3)
    assert (got["none"] - ref).abs().max() > 0.1  # the scaling shows in these logits
