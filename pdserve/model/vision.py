"""A ViT vision tower (CLIP or SigLIP) and the LLaVA projector, in plain PyTorch.

It turns preprocessed pixels [images, 3, H, W] into one embedding per image token in the
decoder's hidden size. The tower runs only up to the layer LLaVA reads its features from
(`feature_layer`, -2 by default): later layers would be computed for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

_ACTS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


@dataclass
class VisionSpec:
    """Shape of the tower and projector, from a LLaVA config.json (`vision_config` and the top level)."""

    kind: str = "clip"  # clip | siglip
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    image_size: int = 336
    patch_size: int = 14
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    feature_layers: list[int] = field(default_factory=lambda: [-2])
    select_strategy: str = "default"  # default: drop the CLS position; full: keep it
    projector_act: str = "gelu"
    projector_bias: bool = True
    text_hidden_size: int = 4096
    image_token_id: int = 32000

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Image tokens in the prompt per image: one per patch, plus CLS kept by "full" (CLIP only)."""
        cls = 1 if self.kind == "clip" else 0
        return self.num_patches + cls - (1 if self.select_strategy == "default" else 0)

    @classmethod
    def from_llava_config(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionSpec:
        vc = cfg["vision_config"]
        kind = "siglip" if "siglip" in vc.get("model_type", "clip") else "clip"
        layers = cfg.get("vision_feature_layer", -2)
        token = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
        return cls(
            kind=kind,
            hidden_size=vc.get("hidden_size", 1024),
            intermediate_size=vc.get("intermediate_size", 4096),
            num_layers=vc.get("num_hidden_layers", 24),
            num_heads=vc.get("num_attention_heads", 16),
            image_size=vc.get("image_size", 336),
            patch_size=vc.get("patch_size", 14),
            layer_norm_eps=vc.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6),
            hidden_act=vc.get("hidden_act", "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh"),
            feature_layers=list(layers) if isinstance(layers, (list, tuple)) else [layers],
            select_strategy=cfg.get("vision_feature_select_strategy", "default"),
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=cfg.get("multimodal_projector_bias", True),
            text_hidden_size=text_hidden_size,
            image_token_id=int(token),
        )


def _ln(x: torch.Tensor, w: dict, name: str, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w[name + ".bias"], eps)


def _lin(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


class VisionEncoder:
    """Tower + projector. `weights` in canonical names: `vision.<HF vision_model names>` and
    `projector.linear_1/2` (loader.py maps each checkpoint layout onto them)."""

    def __init__(
        self,
        spec: VisionSpec,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.w = {
            k: v.to(dtype=dtype, device=self.device)
            for k, v in weights.items()
            if k.startswith(("vision.", "projector."))
        }
        n = spec.num_layers
        wanted = [li + n + 1 if li < 0 else li for li in spec.feature_layers]
        if not all(0 <= li <= n for li in wanted):
            raise ValueError(f"vision_feature_layer {spec.feature_layers} outside the tower's {n} layers")
        self.feature_layers = wanted  # indices into [embeddings, layer 1 out, ..., layer n out]
        self.act = _ACTS[spec.hidden_act]
        self.projector_act = _ACTS[spec.projector_act]

    def _embed(self, pixels: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.w
        x = (
            F.conv2d(
                pixels,
                w["vision.embeddings.patch_embedding.weight"],
                w.get("vision.embeddings.patch_embedding.bias"),
                stride=s.patch_size,
            )
            .flatten(2)
            .transpose(1, 2)
        )  # [B, patches, hidden]
        if s.kind == "clip":
            cls = w["vision.embeddings.class_embedding"].expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], 1)
        x = x + w["vision.embeddings.position_embedding.weight"][: x.shape[1]]
        if s.kind == "clip":
            x = _ln(x, w, "vision.pre_layrnorm", s.layer_norm_eps)
        return x

    def _layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        s, w, p = self.spec, self.w, f"vision.encoder.layers.{i}."
        b, t, _ = x.shape
        hd = s.hidden_size // s.num_heads
        h = _ln(x, w, p + "layer_norm1", s.layer_norm_eps)
        q, k, v = (
            _lin(h, w, p + f"self_attn.{n}_proj").view(b, t, s.num_heads, hd).transpose(1, 2) for n in "qkv"
        )
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, s.hidden_size)
        x = x + _lin(a, w, p + "self_attn.out_proj")
        h = _ln(x, w, p + "layer_norm2", s.layer_norm_eps)
        return x + _lin(self.act(_lin(h, w, p + "mlp.fc1")), w, p + "mlp.fc2")

    @torch.inference_mode()
    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, tokens_per_image, vision hidden * len(feature_layers)]: the selected hidden states."""
        x = self._embed(pixels.to(dtype=self.dtype, device=self.device))
        states = [x]
        for i in range(max(self.feature_layers)):
            x = self._layer(i, x)
            states.append(x)
        feats = torch.cat([states[li] for li in self.feature_layers], -1)
        return feats[:, 1:] if self.spec.select_strategy == "default" else feats

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, tokens_per_image, text hidden]: what replaces each image's placeholder tokens."""
        h = _lin(self.features(pixels), self.w, "projector.linear_1")
        return _lin(self.projector_act(h), self.w, "projector.linear_2")


def canonical_vision_name(key: str) -> str | None:
    """A LLaVA checkpoint's name for a vision or projector weight -> ours (None: not one of them).
    Layouts: `vision_tower.vision_model.*` (hub checkpoints), `vision_tower.*` and `model.vision_tower.*`
    (transformers >= 5), `multi_modal_projector.*` with or without `model.`."""
    k = key[len("model.") :] if key.startswith("model.") else key
    for prefix in ("vision_tower.vision_model.", "vision_tower."):
        if k.startswith(prefix):
            return "vision." + k[len(prefix) :]
    if k.startswith("multi_modal_projector."):
        return "projector." + k[len("multi_modal_projector.") :]
    return None


def tiny_vision_weights(spec: VisionSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random tower and projector for tests, scaled so that image embeddings move the logits."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / (shape[-1] ** 0.5)

    h, f = spec.hidden_size, spec.intermediate_size
    w = {
        "vision.embeddings.patch_embedding.weight": rand(h, 3, spec.patch_size, spec.patch_size) * 4,
        "vision.embeddings.position_embedding.weight": torch.randn(spec.num_patches + 1, h, generator=g),
        "vision.embeddings.class_embedding": torch.randn(h, generator=g),
        "vision.pre_layrnorm.weight": torch.ones(h),
        "vision.pre_layrnorm.bias": torch.zeros(h),
        "projector.linear_1.weight": rand(spec.text_hidden_size, h * len(spec.feature_layers)),
        "projector.linear_1.bias": torch.zeros(spec.text_hidden_size),
        "projector.linear_2.weight": rand(spec.text_hidden_size, spec.text_hidden_size) * 2,
        "projector.linear_2.bias": torch.zeros(spec.text_hidden_size),
    }
    for i in range(spec.num_layers):
        p = f"vision.encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2"):
            w[p + n + ".weight"], w[p + n + ".bias"] = torch.ones(h), torch.zeros(h)
        for n in "qkv":
            w[p + f"self_attn.{n}_proj.weight"], w[p + f"self_attn.{n}_proj.bias"] = (
                rand(h, h),
                torch.zeros(h),
            )
        w[p + "self_attn.out_proj.weight"], w[p + "self_attn.out_proj.bias"] = rand(h, h), torch.zeros(h)
        w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"] = rand(f, h), torch.zeros(f)
        w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"] = rand(h, f), torch.zeros(h)
    return w
