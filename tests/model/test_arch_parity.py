"""Logits of our model == HF transformers' on tiny random Llama / Qwen2 / Mistral checkpoints.

The checkpoint goes through our Hugging Face directory loader, and our side runs the prompt in
chunks through the paged KV cache, then decodes a few tokens, so that every path is covered.
"""

from __future__ import annotations

import pytest
import torch
from paged_logits import paged_logits

from pdserve.model.loader import build_model, default_gguf_path, load_gguf_tokenizer, load_hf_dir

BLOCK = 4


def _hf_model(kind: str, **extra):
    import transformers as tf

    common = dict(
        vocab_size=512,
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


CASES = [
    ("llama", {}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            }
        },
    ),
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
