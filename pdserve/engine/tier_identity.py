"""What names and guards this model's KV blocks on a shared disk or Redis.

Block hashes cover token ids only, so everything else that shapes the KV goes into the namespace:
the weights themselves (a digest, not a directory's base name: two models in directories of the
same name must never share blocks), the quantization, the dtype, the cache's dtype, RoPE fixed at
the served length.
A checkpoint on disk is digested from samples of its stored tensors taken as the build reads them, so
start-up reads its files once. The blocks' checksum is keyed with the internal token where one is set, so a process without it
cannot plant blocks that other workers would load."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pdserve.config import Config
from pdserve.model.arch import ModelArch
from pdserve.model.hf_files import DIGEST_SAMPLES
from pdserve.model.kv_dtype import resolve_kv_dtype
from pdserve.model.stored_quant import resolve_quantization

# Elements read from each tensor: any two different checkpoints (a fine-tune changes every matrix)
# differ there, and the digest costs milliseconds for any model size.
_SAMPLES = DIGEST_SAMPLES


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors a loaded weight is made of (a quantized one holds several)."""
    if isinstance(value, torch.Tensor):
        return [value]
    parts = [getattr(value, name, None) for name in ("q", "scale", "zero")]
    return [p for p in parts if isinstance(p, torch.Tensor)]


def digested_as_read(weights: Mapping[str, Any]) -> bool:
    """Whether `weights` is a checkpoint on disk that samples its tensors for the digest as the build
    reads them (hf_files.HFWeights, moe.StreamedMoEWeights): digest it after the build, and the files
    are read once."""
    return callable(getattr(weights, "digest", None))


def weights_digest(weights: Mapping[str, Any]) -> str:
    """A digest of the weights: every tensor's name, shape, dtype and a spread sample of its values; a
    checkpoint on disk gives its own (of the stored tensors, hf_files.HFWeights.digest), with no read
    beyond what the build has read."""
    if digested_as_read(weights):
        return weights.digest()  # type: ignore[attr-defined]
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        for t in _tensors(weights[name]):
            flat = t.detach().reshape(-1)
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            if flat.numel():
                # Evenly spaced, first and last included; in integers (a float linspace rounds past the end).
                k = min(flat.numel(), _SAMPLES)
                idx = torch.arange(k, dtype=torch.int64) * (flat.numel() - 1) // max(k - 1, 1)
                h.update(flat[idx].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def tier_namespace(
    config: Config, max_model_len: int, weights: Mapping[str, Any] | str, arch: ModelArch | None = None
) -> str:
    """`<readable name>-<digest>`: the name for people, the digest for correctness. `weights`: the
    weights, or their digest (`weights_digest`) taken already; `arch`: the model's, where it is known."""
    mc = config.model
    base = re.sub(r"[^A-Za-z0-9._-]", "_", Path(mc.name).name) or "model"
    quant = resolve_quantization(mc.quantization, mc.name)  # `auto` and what it resolves to name the same KV
    digest = weights if isinstance(weights, str) else weights_digest(weights)
    key = f"{digest}|{mc.dtype}|{max_model_len}|{quant}"
    if mc.activation_quantization != "none":  # int8 activations write other KV; the default's names stay
        key += f"|activations={mc.activation_quantization}"
    kv_dtype = resolve_kv_dtype(config, arch)  # `auto` and what it resolves to name the same KV
    if kv_dtype != mc.dtype:  # rounded KV: other blocks
        key += f"|kv={kv_dtype}"
    return f"{base}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"


def tier_key(config: Config) -> bytes | None:
    """The key of the tier blocks' checksum: derived from the internal token (None without one)."""
    token = config.server.internal_token or os.environ.get("PDSERVE_INTERNAL_TOKEN")
    if not token:
        return None
    return hashlib.blake2b(token.encode(), digest_size=32, person=b"pdserve-kv-tier").digest()
