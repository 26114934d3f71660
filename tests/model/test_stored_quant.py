"""model.quantization auto (the default): a GGUF file serves as it is stored (Q4_0/Q4_1 int4, Q8_0 and
other quantized types int8, float types none), a mixed file by the majority of its linear layers'
bytes; Hugging Face directories and the tiny random models in float. The resolved value is what the
engine serves, logs and names its KV with, so `auto` and the value it resolves to agree everywhere
two workers compare (the KV tiers' namespace, the KV plane's compatibility information); an explicit
`none` still serves float32."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pdserve import LLM, SamplingParams
from pdserve.config import load_config
from pdserve.engine.tier_identity import tier_namespace
from pdserve.model.describe import default_gguf_path
from pdserve.model.loader import load_model_files
from pdserve.model.quant import QuantizedWeight
from pdserve.model.stored_quant import (
    gguf_stored_quantization,
    resolve_quantization,
    stored_quantization,
    with_resolved_quantization,
)

MODEL = "smollm2-135m"


def _write_gguf(path, layer_types: list[T], rows: int = 64, cols: int = 64):
    """A GGUF file whose layer i has attn_q and ffn_down of type layer_types[i] (zeros: only the
    header's types are read), and a float32 norm that must not count."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(len(layer_types))
    for i, t in enumerate(layer_types):
        for name in ("attn_q", "ffn_down"):
            block, size = gguf.GGML_QUANT_SIZES[t]
            if t == T.F32:
                data, raw = np.zeros((rows, cols), np.float32), None
            elif t == T.F16:
                data, raw = np.zeros((rows, cols), np.float16), None
            else:
                data, raw = np.zeros((rows, cols // block * size), np.uint8), t
            w.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=raw)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(cols, np.float32))
    w.add_tensor("token_embd.weight", np.zeros((rows, cols), np.float32))  # not a linear layer
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "stored, expected",
    [
        (T.Q4_0, "int4"),
        (T.Q4_1, "int4"),
        (T.Q8_0, "int8"),
        (T.Q6_K, "int8"),  # no 4-bit re-rounding of values rounded once already
        (T.F32, "none"),
        (T.F16, "none"),
        (T.BF16, "none"),
    ],
)
def test_auto_resolves_to_the_stored_type(tmp_path, stored, expected):
    cols = 256 if stored == T.Q6_K else 64  # a K-quant block holds 256 values
    path = _write_gguf(tmp_path / "m.gguf", [stored, stored], cols=cols)
    assert gguf_stored_quantization(path) == expected
    assert resolve_quantization("auto", str(path)) == expected
    assert resolve_quantization("none", str(path)) == "none"  # an explicit value is never replaced


def test_a_mixed_file_goes_by_the_majority_of_linear_bytes(tmp_path):
    # Two Q4_0 layers (2 x 2 x 2304 bytes) outweigh one Q8_0 layer (2 x 4352) ...
    assert gguf_stored_quantization(_write_gguf(tmp_path / "a.gguf", [T.Q4_0, T.Q4_0, T.Q8_0])) == "int4"
    # ... three do not outweigh one F16 layer (2 x 8192): bytes, not tensors, decide.
    mixed = _write_gguf(tmp_path / "b.gguf", [T.Q4_0, T.Q4_0, T.Q4_0, T.F16])
    assert gguf_stored_quantization(mixed) == "none"


def test_the_packaged_model_and_other_sources():
    assert gguf_stored_quantization(default_gguf_path()) == "int4"  # SmolLM2's Q4_1 file
    assert stored_quantization(MODEL) == "int4"
    for tiny in ("tiny-llama", "tiny-qwen2", "tiny-mixtral"):
        assert stored_quantization(tiny) == "none"


def test_hugging_face_directories_resolve_to_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_quantization("auto", str(tmp_path)) == "none"


def test_auto_is_the_default_and_resolves_in_the_config_the_engine_reads():
    cfg = load_config()
    assert cfg.model.quantization == "auto"
    assert with_resolved_quantization(cfg).model.quantization == "int4"
    tiny = load_config(None, {"model.name": "tiny-llama"})
    assert with_resolved_quantization(tiny).model.quantization == "none"
    explicit = load_config(None, {"model.quantization": "int8"})
    assert with_resolved_quantization(explicit) is explicit


@pytest.fixture(scope="module")
def auto_llm(smollm_files):
    """The default: auto on the packaged file, here from the session's float copy of its weights."""
    return LLM(model=MODEL, loaded=smollm_files)


def test_the_engine_serves_logs_and_reports_the_resolved_value(smollm_files, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.engine.engine"):
        llm = LLM(model=MODEL, loaded=smollm_files, max_num_seqs=4)
    assert llm.config.model.quantization == llm.engine.config.model.quantization == "int4"
    assert "quantization int4 (auto: as stored)" in caplog.text
    assert llm.engine.weight_bytes < 150e6  # packed 4-bit linear layers, not 540 MB of float32


def test_explicit_none_still_serves_float32(smollm_llm, auto_llm):
    assert smollm_llm.config.model.quantization == "none"
    assert smollm_llm.engine.weight_bytes > 4 * auto_llm.engine.weight_bytes
    model = smollm_llm.engine.model
    assert model.quantization == "none"
    linear = [model.lm_head, *(w for layer in model.layers for w in (layer.qkv, layer.o))]
    assert not any(isinstance(w, QuantizedWeight) for w in linear)
    assert isinstance(auto_llm.engine.model.layers[0].qkv, QuantizedWeight)


def test_auto_equals_int4_loaded_as_stored(auto_llm):
    # The Q4_1 blocks packed from a float copy and the blocks loaded as they are: the same weights.
    stored = LLM(model=MODEL, loaded=load_model_files(MODEL, quantization="auto"), quantization="int4")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "The capital of France is"
    assert auto_llm.generate(prompt, params)[0].token_ids == stored.generate(prompt, params)[0].token_ids


def test_auto_and_explicit_int4_name_the_same_kv(smollm_files):
    auto, int4, none = (load_config(None, {"model.quantization": q}) for q in ("auto", "int4", "none"))
    w = smollm_files.weights
    assert tier_namespace(auto, 2048, w) == tier_namespace(int4, 2048, w) != tier_namespace(none, 2048, w)


def test_prefill_and_decode_workers_with_auto_carry_the_resolved_value():
    from pdserve.disagg.receiver import DecodeConnector
    from pdserve.disagg.sender import PrefillConnector

    kv = torch.zeros(2, 2, 8, 1, 4)
    auto = load_config(None, {"model.quantization": "auto"})
    prefill = PrefillConnector(auto, kv, "tcp://127.0.0.1:*")
    try:
        for decode_q in ("auto", "int4"):
            decode = DecodeConnector(
                load_config(None, {"model.quantization": decode_q}), kv, None, "tcp://127.0.0.1:*"
            )
            try:
                assert prefill.compat == decode.compat
                assert decode.compat["quantization"] == "int4"
            finally:
                decode.close()
    finally:
        prefill.close()
