"""Multi-head latent attention (DeepSeek-V2, V2-Lite, V3, R1, Kimi-K2) over a paged KV cache of latents.

A token's keys and values are compressed into one latent row: c = RMSNorm(kv_a(h)[:kv_lora_rank]) and
one rope key shared by all heads, k_pe = rope(kv_a(h)[kv_lora_rank:]). The cache holds exactly
[c, k_pe] (kv_lora_rank + qk_rope_head_dim values per token per layer, one plane of one "head",
arch.kv_layout); kv_b_proj is the up-projection c -> per-head (k_nope, v).

Prefill expands the latents of its context to per-head K and V (a few tokens' work per key, paid
once). Decode absorbs the up-projection instead ("weight absorption"): per head h,
q_nope . k_nope = (q_nope W_UK[h]) . c, so the query becomes [q_nope W_UK[h], q_pe] and attends to
the cached rows as they are, all heads against one shared key (multi-query attention); the output
is the attention-weighted latent, taken up by W_UV[h] afterwards. A decode step then reads
kv_lora_rank + rope values per cached token instead of expanding every one of them to
heads x (nope + v) values.

The rope dimensions of DeepSeek's checkpoints come in (x0, x1), (x2, x3) pairs; the q and kv_a rows
of those dimensions are reordered at load to [even..., odd...] so that the half-split rotation of
rotary.py turns them (the same scores: q and k get the same order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.model.arch import ModelArch
from pdserve.model.attention import AttentionMetadata, _gather_blocks
from pdserve.model.chunk_attention import prefix_then_causal
from pdserve.model.linear import linear
from pdserve.model.llama import DecoderLayer, rms_norm
from pdserve.model.rotary import apply_rotary, yarn_mscale

# DeepSeek builds q_a_layernorm and kv_a_layernorm with the RMSNorm default, not the config's eps.
LATENT_NORM_EPS = 1e-6

ATTN_KEYS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def softmax_scale(arch: ModelArch) -> float:
    """DeepSeek's: 1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    s = arch.rope_scaling or {}
    if s.get("mscale_all_dim"):
        m = yarn_mscale(float(s.get("factor", 1.0)), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale


def _rope_order(rope: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def _deinterleave_rows(w: torch.Tensor, period: int, start: int, rope: int) -> torch.Tensor:
    """Rows [start, start + rope) of every `period` rows reordered pairs-first (see the module doc)."""
    rows = w.shape[0]
    idx = torch.arange(rows).view(rows // period, period)
    idx[:, start : start + rope] = idx[:, start : start + rope][:, _rope_order(rope)]
    return w[idx.reshape(-1)]


def _plain(w) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):  # quant.Staged: only GGUF files store those, none holds MLA
        raise ValueError("multi-head latent attention weights must be float tensors")
    return w


class MLALayer(DecoderLayer):
    """A decoder layer whose attention is MLA; `forward` (DecoderLayer's) passes the layer's one
    latent plane as k_cache (v_cache is unused)."""

    def __init__(
        self,
        arch: ModelArch,
        w: dict[str, torch.Tensor],
        prefix: str,
        pack: Callable,
        mlp: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`w`: the model's weights in HF naming; this layer's are under `prefix` (model.layers.i.)."""
        a = self.arch = arch
        self.input_norm = w[prefix + "input_layernorm.weight"]
        self.post_norm = w[prefix + "post_attention_layernorm.weight"]
        self.mlp = mlp
        self.decode_kernel = None
        self.q_norm = self.k_norm = None
        self.qkv_bias = None
        p = prefix + "self_attn."
        nope, rope, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        qk = nope + rope

        def fix(w: torch.Tensor, period: int, start: int) -> torch.Tensor:
            return _deinterleave_rows(_plain(w), period, start, rope) if a.rope_interleave else _plain(w)

        def bias(name: str) -> torch.Tensor | None:
            b = w.get(p + name + ".bias")
            return None if b is None else b.to(dtype=dtype, device=device)

        if a.q_lora_rank:
            self.q_a, self.q_a_bias = pack(w[p + "q_a_proj.weight"]), bias("q_a_proj")
            self.q_a_norm = w[p + "q_a_layernorm.weight"].to(dtype=dtype, device=device)
            self.q_b = pack(fix(w[p + "q_b_proj.weight"], qk, nope))
        else:
            self.q_a = None
            self.q_b = pack(fix(w[p + "q_proj.weight"], qk, nope))
        kv_a = fix(w[p + "kv_a_proj_with_mqa.weight"], r + rope, r)
        self.kv_a = pack(kv_a)
        kv_a_bias = bias("kv_a_proj_with_mqa")
        self.kv_a_bias = None if kv_a_bias is None else fix(kv_a_bias, r + rope, r)
        self.kv_a_norm = w[p + "kv_a_layernorm.weight"].to(dtype=dtype, device=device)
        # kv_b [H * (nope + v), r] stays float: prefill multiplies by it whole; decode reads its two
        # halves per head as views (W_UK [H, nope, r], and W_UV transposed [H, r, v]).
        self.kv_b = _plain(w[p + "kv_b_proj.weight"]).to(dtype=dtype, device=device).contiguous()
        per_head = self.kv_b.view(a.num_heads, nope + a.v_head_dim, r)
        self.w_uk = per_head[:, :nope]
        self.w_uv_t = per_head[:, nope:].transpose(1, 2)
        self.o = pack(w[p + "o_proj.weight"])
        self.o_bias = bias("o_proj")
        self.scale = softmax_scale(a)
        self.absorb = True  # False: decodes expand their whole context too (the benchmark's baseline)

    def attention_weights(self) -> list:
        q = [self.q_a, self.q_a_norm, self.q_b] if self.q_a is not None else [self.q_b]
        return [*q, self.kv_a, self.kv_a_norm, self.kv_b, self.o]

    # ------------------------------------------------------------------ the step

    def attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        a = self.arch
        t, heads = x.shape[0], a.num_heads
        nope, r = a.qk_nope_head_dim, a.kv_lora_rank
        h = rms_norm(x, self.input_norm, a.rms_norm_eps)
        if self.q_a is not None:
            qa = linear(h, self.q_a)
            if self.q_a_bias is not None:
                qa = qa + self.q_a_bias
            q = linear(rms_norm(qa, self.q_a_norm, LATENT_NORM_EPS), self.q_b)
        else:
            q = linear(h, self.q_b)
        q = q.view(t, heads, nope + a.qk_rope_head_dim)
        ckv = linear(h, self.kv_a)
        if self.kv_a_bias is not None:
            ckv = ckv + self.kv_a_bias
        latent = torch.empty(t, r + a.qk_rope_head_dim, dtype=x.dtype, device=x.device)
        latent[:, :r] = rms_norm(ckv[:, :r], self.kv_a_norm, LATENT_NORM_EPS)
        latent[:, r:] = apply_rotary(ckv[:, None, r:], cos, sin)[:, 0]
        q_pe = apply_rotary(q[..., nope:], cos, sin)
        k_cache.index_copy_(0, meta.slot_mapping, latent.unsqueeze(1))
        out = torch.empty(t, heads, a.v_head_dim, dtype=x.dtype, device=x.device)
        decodes = sum(g.block_idx.shape[0] for g in meta.decode_groups)
        if decodes:
            if self.absorb:
                self._absorbed_decodes(q[:decodes, :, :nope], q_pe[:decodes], k_cache, meta, out)
            else:
                self._expanded_decodes(q[:decodes, :, :nope], q_pe[:decodes], k_cache, meta, out)
        for c in meta.prefills:
            self._prefill(c, q, q_pe, latent, k_cache, meta.block_size, out)
        o = linear(out.view(t, heads * a.v_head_dim), self.o)
        if self.o_bias is not None:
            o = o + self.o_bias
        return x + o

    def _absorbed_decodes(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """One query row per (decode, head) against the decode's cached latent rows, as they are."""
        r = self.arch.kv_lora_rank
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [n, H, r]
        q_abs = torch.cat([q_lat, q_pe], dim=-1)  # [n, H, r + rope]
        o_lat = torch.empty_like(q_lat)
        bs = meta.block_size
        if self.decode_kernel is not None:
            # The native paged kernel (float32 CPU) reads the latent rows in place, no gather: one KV
            # head whose key and value rows are both the latent row; the value's rope columns of the
            # output are dropped (they cost rope / (r + rope) of the value pass).
            o_full = torch.empty_like(q_abs)
            for g in meta.decode_groups:
                n = g.block_idx.shape[0]
                first, ctx = g.attended()
                rows = slice(g.start, g.start + n)
                self.decode_kernel(
                    q_abs[rows], cache, cache, g.block_idx, first, ctx, bs, self.scale, o_full[rows]
                )
            o_lat = o_full[..., :r]
        for g in meta.decode_groups if self.decode_kernel is None else ():
            n = g.block_idx.shape[0]
            rows = _gather_blocks(cache, g.block_idx, bs).view(n, -1, cache.shape[-1])  # [n, L, D]
            # Every head's query against the one shared key row (all of the latent row) and value row
            # (its first r values): two batched products. (torch's CPU flash kernel runs one task per
            # (decode, head) with no split of the keys, ~20x slower for 16 query rows and one head.)
            scores = torch.bmm(q_abs[g.start : g.start + n], rows.transpose(1, 2))  # [n, H, L]
            scores = scores.float().mul_(self.scale).masked_fill_(~g.mask.view(n, 1, -1), float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(rows.dtype)
            o_lat[g.start : g.start + n] = torch.bmm(probs, rows[:, :, :r])
        out[: q_nope.shape[0]] = torch.bmm(o_lat.transpose(0, 1), self.w_uv_t).transpose(0, 1)

    def _expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [S, r + rope] -> K [S, H, nope + rope], V [S, H, v]."""
        a = self.arch
        nope, r = a.qk_nope_head_dim, a.kv_lora_rank
        s = lat.shape[0]
        kv = linear(lat[:, :r], self.kv_b).view(s, a.num_heads, nope + a.v_head_dim)
        k = torch.empty(s, a.num_heads, nope + a.qk_rope_head_dim, dtype=lat.dtype, device=lat.device)
        k[..., :nope] = kv[..., :nope]
        k[..., nope:] = lat[:, None, r:]
        return k, kv[..., nope:]

    def _expanded_decodes(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Every decode expands its whole context to per-head K and V (what absorption avoids)."""
        q = torch.cat([q_nope, q_pe], dim=-1)
        bs = meta.block_size
        for g in meta.decode_groups:
            n = g.block_idx.shape[0]
            k, v = self._expand(_gather_blocks(cache, g.block_idx, bs).view(-1, cache.shape[-1]))
            v = _pad(v, k.shape[-1]).view(n, -1, *k.shape[1:]).transpose(1, 2)
            k = k.view(n, -1, *k.shape[1:]).transpose(1, 2)  # [n, H, L, qk]
            qd = q[g.start : g.start + n].unsqueeze(2)  # [n, H, 1, qk]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=g.mask, scale=self.scale)
            out[g.start : g.start + n] = o[:, :, 0, : out.shape[-1]]

    def _prefill(self, c, q_nope_pe, q_pe, latent, cache, bs, out) -> None:
        """One prefill chunk, its context expanded to per-head K and V."""
        nope, vd = self.arch.qk_nope_head_dim, self.arch.v_head_dim
        span = slice(c.q_start, c.q_start + c.q_len)
        q = torch.cat([q_nope_pe[span, :, :nope], q_pe[span]], dim=-1).transpose(0, 1).unsqueeze(0)
        dim = q.shape[-1]

        def heads_first(lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = self._expand(lat)
            return k.transpose(0, 1).unsqueeze(0), _pad(v, dim).transpose(0, 1).unsqueeze(0)

        if c.prefix_len:
            pk, pv = heads_first(_gather_blocks(cache, c.block_idx, bs)[: c.prefix_len, 0])
            ok, ov = heads_first(latent[span])
            o = prefix_then_causal(q, pk, pv, ok, ov, self.scale)
        else:
            lat = latent[span] if c.block_idx is None else _gather_blocks(cache, c.block_idx, bs)[:, 0]
            k, v = heads_first(lat)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=c.mask, is_causal=c.mask is None, scale=self.scale
            )
        out[span] = o[0, :, :, :vd].transpose(0, 1)


def _pad(v: torch.Tensor, dim: int) -> torch.Tensor:
    """V padded with zeros to the query/key head size: CPU flash attention wants one head size
    (the extra output columns are zero and dropped)."""
    return v if v.shape[-1] == dim else F.pad(v, (0, dim - v.shape[-1]))


def tiny_mla_weights(arch: ModelArch, layer: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random MLA attention weights of one layer in HF naming (loader.tiny_random_weights does the rest)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / (shape[-1] ** 0.5)

    a, h = arch, arch.hidden_size
    p = f"model.layers.{layer}.self_attn."
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    w: dict[str, torch.Tensor] = {}
    if a.q_lora_rank:
        w[p + "q_a_proj.weight"] = rand(a.q_lora_rank, h)
        w[p + "q_a_layernorm.weight"] = 1 + 0.1 * torch.randn(a.q_lora_rank, generator=g)
        w[p + "q_b_proj.weight"] = rand(a.num_heads * qk, a.q_lora_rank)
    else:
        w[p + "q_proj.weight"] = rand(a.num_heads * qk, h)
    w[p + "kv_a_proj_with_mqa.weight"] = rand(a.kv_lora_rank + a.qk_rope_head_dim, h)
    w[p + "kv_a_layernorm.weight"] = 1 + 0.1 * torch.randn(a.kv_lora_rank, generator=g)
    w[p + "kv_b_proj.weight"] = rand(a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
    w[p + "o_proj.weight"] = rand(h, a.num_heads * a.v_head_dim)
    return w
