"""`model.quantization: auto`: serve the weights as they are stored. Torch-free and numpy-free (the
dry run, the planner and the KV plane resolve it too): a GGUF file's tensor types come from its
header, no tensor is mapped.

- GGUF whose linear layers are Q4_0 / Q4_1: int4 (those tensors load as they are, no float copy);
- Q8_0: int8;
- other quantized GGUF types (Q5_*, K-quants, IQ*): int8, the nearest form pdserve keeps, without
  the second 4-bit rounding int4 would add to values already rounded once;
- float GGUF types (F32, F16, BF16), Hugging Face directories, MoE and the tiny random models: none.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from pdserve.common.gguf_file import GGUFFile
from pdserve.common.model_names import resolve_model
from pdserve.config import Config, derive
from pdserve.model.describe import DEFAULT_MODEL, default_gguf_path

AUTO = "auto"

# ggml type id -> (elements per block, bytes per block): what a tensor of that type weighs on disk.
_GGML_SIZES = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 40),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    20: (32, 18),  # IQ4_NL
    23: (256, 136),  # IQ4_XS
    28: (1, 8),  # F64
    30: (1, 2),  # BF16
}
_FLOAT_TYPES = frozenset({0, 1, 28, 30})
_INT4_TYPES = frozenset({2, 3})  # Q4_0, Q4_1: loader.load_gguf keeps them packed
# The linear layers (what model.quantization applies to); embeddings and norms do not count.
_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_tensor_types(path: Path) -> list[tuple[str, int, int]]:
    """(name, ggml type id, elements) of every tensor of a GGUF file, read from its header."""
    with GGUFFile(path, arrays=False) as gf:
        return [(t.name, t.type_id, math.prod(t.dims)) for t in gf.tensor_infos]


def _mode_of(ttype: int) -> str:
    if ttype in _FLOAT_TYPES:
        return "none"
    return "int4" if ttype in _INT4_TYPES else "int8"


def gguf_stored_quantization(path: Path) -> str:
    """The quantization that serves a GGUF file's linear layers as stored. A file mixing types (llama.cpp's
    _M / _S mixes keep some layers at higher precision) goes by the majority of the linear layers' bytes
    on disk; a tie goes to the more precise mode."""
    weight = {"none": 0, "int8": 0, "int4": 0}
    for name, ttype, elements in gguf_tensor_types(path):
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR and parts[3] == "weight":
            block, size = _GGML_SIZES.get(ttype, (1, 1))
            weight[_mode_of(ttype)] += elements * size // block
    return max(weight, key=lambda m: (weight[m], m == "none", m == "int8"))


@lru_cache(maxsize=32)
def stored_quantization(name: str) -> str:
    """What `auto` resolves to for the model `name` (as model.name takes it)."""
    name = resolve_model(name)
    if name == DEFAULT_MODEL:
        return gguf_stored_quantization(default_gguf_path())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_stored_quantization(path)
    return "none"  # tiny random models (float by construction), Hugging Face directories


def resolve_quantization(quantization: str, name: str) -> str:
    """`quantization` as it applies to model `name`: `auto` becomes what the weights are stored as."""
    return stored_quantization(name) if quantization == AUTO else quantization


def with_resolved_quantization(config: Config, name: str | None = None) -> Config:
    """`config` with model.quantization resolved for the model `name` (default model.name): what the engine
    serves, logs, and names its KV tiers and transfers with, so workers given `auto` and workers given
    the value it resolves to agree."""
    q = config.model.quantization
    if q != AUTO:
        return config
    return derive(config, {"model.quantization": stored_quantization(name or config.model.name)})
