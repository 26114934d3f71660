"""Rotary position embedding with the usual scaling options (linear, dynamic NTK, llama3, yarn, and
per-frequency factors as GGUF files store them)."""

from __future__ import annotations

import math
from typing import Any

import torch


def _yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _inv_freq_and_scale(
    head_dim: int, base: float, scaling: dict[str, Any] | None, max_pos: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] float64, attention scaling factor applied to cos/sin)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "freq_factors":
        # A GGUF's rope_freqs tensor (llama.cpp's converter stores Llama 3's scaling so): each
        # frequency divided by its own factor, as llama.cpp's rope applies it.
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope_freqs has {factors.numel()} factors; head_dim {head_dim} needs {inv_freq.numel()}"
            )
        return inv_freq / factors, 1.0
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        # Fixed at the longest context the scaled model serves; paged KV cannot re-rotate cached keys.
        orig = scaling.get("original_max_position_embeddings", max_pos)
        new_base = base * ((factor * max_pos / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (new_base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)), 1.0
    if kind == "llama3":
        low_ff = float(scaling.get("low_freq_factor", 1.0))
        high_ff = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = orig / low_ff, orig / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        orig = int(scaling.get("original_max_position_embeddings", max_pos))
        beta_fast = float(scaling.get("beta_fast", 32))
        beta_slow = float(scaling.get("beta_slow", 1))
        mscale = scaling.get("attention_factor")
        if mscale is None:
            # DeepSeek's configs give both mscale and mscale_all_dim: the cos/sin factor is their ratio.
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            mscale = (
                yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
            )
        low = _yarn_find_correction_dim(beta_fast, head_dim, base, orig)
        high = _yarn_find_correction_dim(beta_slow, head_dim, base, orig)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv, float(mscale)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position (non-interleaved, HF layout)."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        max_pos: int,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq, attn_scale = _inv_freq_and_scale(head_dim, base, scaling, max_pos)
        # Compute in float32 like the reference implementation so positions round identically.
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(torch.float32))
        self.cos = (freqs.cos() * attn_scale).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * attn_scale).to(dtype=dtype, device=device)
        self.max_pos = max_pos

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [T, 1, head_dim/2], computed once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate the two halves of each head."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
