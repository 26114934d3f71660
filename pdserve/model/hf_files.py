"""Reading a Hugging Face model directory's weights."""

from __future__ import annotations

from pathlib import Path

import torch


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files, as float32, by its HF name."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    return weights
