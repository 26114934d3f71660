"""LLaVA-style vision-language models: a vision tower and projector (vision.py) in front of the
Llama-family decoder (llama.py), glued through the decoder's input embeddings.

The decoder is the text model as it is: a step's token embeddings are looked up as usual and the
rows at image positions are replaced by the image's embeddings (`merge_image_embeds`), which the
engine passes to `LlamaModel.forward` as `inputs_embeds`. The tower runs apart from the decoder,
in the engine process or in encoder workers (engine/encoder_pool.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.common.images import TINY_IMAGE_SLOTS, ImageInput, ImageProcessing, image_slots
from pdserve.model.arch import TINY_CONFIGS, TINY_VLMS, ModelArch, is_llava_config, text_config  # noqa: F401
from pdserve.model.hf_files import read_weights
from pdserve.model.vision import VisionEncoder, VisionSpec, canonical_vision_name, tiny_vision_weights


@dataclass
class VisionBundle:
    """What a loaded VLM adds to its decoder: the tower's shape and weights, and the prompt side."""

    spec: VisionSpec
    weights: dict[str, torch.Tensor]
    processing: ImageProcessing
    placeholder: str  # the text standing for one image in a rendered chat (tokenizes to image_token_id)

    def encoder(self, dtype: torch.dtype = torch.float32, device: str = "cpu") -> VisionEncoder:
        return VisionEncoder(self.spec, self.weights, dtype, device)


def split_llava_weights(
    weights: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(decoder weights in text-model names, vision + projector weights in vision.py's names), from
    any of the LLaVA layouts: `language_model.model.*` + `language_model.lm_head.*` (hub checkpoints),
    `model.language_model.*` + `lm_head.*` (transformers >= 5)."""
    text: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        vk = canonical_vision_name(k)
        if vk is not None:
            vision[vk] = v
            continue
        for old, new in (
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("language_model.", "model."),
        ):
            if k.startswith(old):
                k = new + k[len(old) :]
                break
        text[k] = v
    return text, vision


def load_llava_dir(path: Path) -> tuple[ModelArch, dict[str, torch.Tensor], VisionBundle]:
    cfg = json.loads((path / "config.json").read_text())
    arch = ModelArch.from_hf_config(text_config(cfg))
    text, vision = split_llava_weights(read_weights(path))
    return arch, text, _bundle(path, cfg, arch.hidden_size, vision)


def _bundle(path: Path, cfg: dict, text_hidden: int, vision: dict[str, torch.Tensor]) -> VisionBundle:
    """The vision side of a LLaVA directory: its spec, preprocessing and image placeholder."""
    spec = VisionSpec.from_llava_config(cfg, text_hidden)
    pre = path / "preprocessor_config.json"
    processing = ImageProcessing.from_hf(json.loads(pre.read_text()) if pre.exists() else {}, spec.image_size)
    slots = image_slots(str(path))
    return VisionBundle(spec, vision, processing, slots.placeholder if slots else "<image>")


def load_vision(name: str, seed: int = 0) -> VisionBundle | None:
    """The vision tower and projector of a VLM without its decoder (an encoder worker's share):
    from a LLaVA directory only the vision and projector tensors are read. None: no VLM."""
    if name in TINY_VLMS:
        return tiny_vision_bundle(TINY_CONFIGS[TINY_VLMS[name]], seed)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        return None
    cfg = json.loads((path / "config.json").read_text())
    if not is_llava_config(cfg):
        return None
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if (vk := canonical_vision_name(k)) is not None:
                    weights[vk] = st.get_tensor(k).float()
    return _bundle(path, cfg, ModelArch.from_hf_config(text_config(cfg)).hidden_size, weights)


# tiny-llava: tiny-qwen2's decoder (SmolLM2's vocabulary; tiny-llama's greedy output ignores its
# context) behind a 2-layer CLIP tower on 32x32 images (16 patches, so 16 image tokens). SmolLM2
# has no <image> token: an unused special one stands in.
TINY_IMAGE_TOKEN, TINY_PLACEHOLDER = (
    TINY_IMAGE_SLOTS["tiny-llava"].image_token_id,
    TINY_IMAGE_SLOTS["tiny-llava"].placeholder,
)


def tiny_vision_bundle(arch: ModelArch, seed: int) -> VisionBundle:
    spec = VisionSpec(
        kind="clip",
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        image_size=32,
        patch_size=8,
        text_hidden_size=arch.hidden_size,
        image_token_id=TINY_IMAGE_TOKEN,
    )
    processing = ImageProcessing(shortest_edge=32, crop=(32, 32))
    return VisionBundle(spec, tiny_vision_weights(spec, seed + 1), processing, TINY_PLACEHOLDER)


def tiny_text_arch(name: str) -> ModelArch:
    return TINY_CONFIGS[TINY_VLMS[name]]


def merge_image_embeds(
    text_embeds: torch.Tensor, spans: list[tuple[int, int, int, ImageInput]]
) -> torch.Tensor:
    """`text_embeds` [tokens, hidden] of one step with image rows replaced: each span is (row in the
    step, first position of the image covered, count, image)."""
    for row, first, n, im in spans:
        src = im.embeds[first - im.offset : first - im.offset + n]
        text_embeds[row : row + n] = src.to(dtype=text_embeds.dtype, device=text_embeds.device)
    return text_embeds


def image_spans(
    images: list[ImageInput], start: int, n: int, row: int
) -> list[tuple[int, int, int, ImageInput]]:
    """The image rows of a chunk: positions [start, start + n) of a request, placed from step row `row`."""
    out = []
    for im in images:
        lo, hi = max(start, im.offset), min(start + n, im.offset + im.length)
        if lo < hi:
            out.append((row + lo - start, lo, hi - lo, im))
    return out
