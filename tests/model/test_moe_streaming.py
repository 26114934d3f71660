"""A MoE checkpoint on disk loads expert by expert (moe.StreamedMoEWeights, experts.ExpertSource):
- the model it gives is the one the earlier path gave (every tensor read, the experts stacked in
  their stored dtype, then packed), bit for bit: the packed expert stacks and the logits, for bf16
  and FP8 block-scaled experts, stored one by one, in Mixtral's names or as transformers 5's fused
  3-D tensors, in float32, int8 and int4 (the output head quantized as its rows are read), on
  standard and latent attention;
- loading creates no tensor holding a layer's experts other than the packed stack it keeps (the
  earlier path's stacked copy is caught by the same check)."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import CONFIGS, write_checkpoint
from paged_logits import paged_logits
from torch.overrides import TorchFunctionMode

from pdserve.config import ModelConfig
from pdserve.model import hf_files
from pdserve.model.arch import ModelArch
from pdserve.model.hf_files import HFWeights
from pdserve.model.loader import LoadedModel, build_model, load_hf_dir
from pdserve.model.moe import StreamedMoEWeights, canonical_moe_weights
from pdserve.model.quant import quantize


def _eager(path) -> LoadedModel:
    """The earlier path: every tensor read into a dict, each layer's experts stacked in their stored
    dtype (FP8 dequantized to float32), then packed."""
    loaded = load_hf_dir(path)
    return LoadedModel(
        loaded.name,
        loaded.arch,
        canonical_moe_weights(dict(HFWeights.open(path)), loaded.arch),
        loaded.tokenizer,
    )


def _build(loaded: LoadedModel, mode: str, dtype: str = "float32"):
    return build_model(loaded, dtype, model_config=ModelConfig(quantization=mode))


IDS = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize(
    "family,layout,fp8",
    [
        ("qwen3_moe", "experts", False),
        ("qwen3_moe", "fused", True),
        ("mixtral", "experts", False),
        ("deepseek_v3", "experts", True),
        ("deepseek_v3", "fused", False),
    ],
)
@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_streaming_gives_the_model_of_the_earlier_path(tmp_path, monkeypatch, family, layout, fp8, mode):
    # The quantized output head is read 100 rows at a time (HFWeights.quantized), the last read short.
    monkeypatch.setattr(hf_files, "_ROWS_READ", 100 * 64 * 2)
    write_checkpoint(tmp_path / "ckpt", family, layout, fp8)
    loaded = load_hf_dir(tmp_path / "ckpt")
    assert isinstance(loaded.weights, StreamedMoEWeights)
    streamed, eager = _build(loaded, mode).model, _build(_eager(tmp_path / "ckpt"), mode).model
    assert len(streamed.expert_store) == len(loaded.arch.moe_layer_ids())
    for a, b in zip(streamed.expert_store, eager.expert_store, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.kind == y.kind and x.shape == y.shape
            assert x.kind == {"none": x.kind if x.kind == "plain" else "f32"}.get(mode, mode)
            for u, v in zip(x.tensors, y.tensors, strict=True):
                assert u.dtype == v.dtype and torch.equal(u, v)
    got, want = paged_logits(streamed, IDS, chunk=8, decode=4), paged_logits(eager, IDS, chunk=8, decode=4)
    assert want.abs().max() > 1.0  # not vacuous
    assert torch.equal(got, want)


def test_bf16_model_dtype_streams_the_same_plain_stacks(tmp_path):
    write_checkpoint(tmp_path / "ckpt", "qwen3_moe", fp8=True)
    streamed = _build(load_hf_dir(tmp_path / "ckpt"), "none", "bfloat16").model
    eager = _build(_eager(tmp_path / "ckpt"), "none", "bfloat16").model
    for a, b in zip(streamed.expert_store, eager.expert_store, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.kind == "plain" and x.tensors[0].dtype == torch.bfloat16
            assert torch.equal(x.tensors[0], y.tensors[0])


class _Created(TorchFunctionMode):
    """Every tensor a torch call returns of three or more dimensions (a stack of matrices) and at least
    `numel` elements, kept (so that no other tensor reuses its memory before the check)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 3 and out.numel() >= self.numel:
            self.seen.append(out)
        return out


def _copies_beside_the_stacks(load, mode: str) -> list[tuple]:
    """Stacks created while loading and building that hold as many elements as a layer's down experts,
    other than (views of) the packed stacks the model keeps."""
    a = ModelArch.from_hf_config(CONFIGS["qwen3_moe"])
    with _Created(a.num_experts * a.hidden_size * a.moe_intermediate_size) as created:
        model = _build(load(), mode).model
    kept = {t.untyped_storage().data_ptr() for pair in model.expert_store for s in pair for t in s.tensors}
    return [(tuple(t.shape), t.dtype) for t in created.seen if t.untyped_storage().data_ptr() not in kept]


@pytest.mark.parametrize("mode", ["none", "int4"])
@pytest.mark.parametrize("fp8", [False, True])
def test_loading_holds_no_copy_of_a_layers_experts(tmp_path, mode, fp8):
    path = tmp_path / "ckpt"
    write_checkpoint(path, "qwen3_moe", fp8=fp8)
    assert _copies_beside_the_stacks(lambda: load_hf_dir(path), mode) == []
    # The earlier path's stacked copy in the stored dtype (float32 for FP8) is caught.
    assert _copies_beside_the_stacks(lambda: _eager(path), mode)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_matrix_quantized_as_its_rows_are_read_is_quantize_of_the_whole(tmp_path, monkeypatch, mode):
    write_checkpoint(tmp_path / "ckpt", "llama")
    monkeypatch.setattr(hf_files, "_ROWS_READ", 37 * 64 * 2)  # 37 rows a read: 14 reads, the last short
    weights = HFWeights.open(tmp_path / "ckpt")
    got, want = weights.quantized("lm_head.weight", mode), quantize(weights["lm_head.weight"], mode)
    assert got is not None and got.mode == want.mode == mode
    for a, b in ((got.q, want.q), (got.scale, want.scale), (got.zero, want.zero)):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    assert weights.quantized("model.norm.weight", mode) is None  # not a matrix
