"""Llama-family decoder (SmolLM2, Llama, Qwen2, Mistral) in plain PyTorch over a paged KV cache.

Weights are stored fused (qkv, gate+up), [out, in] as in HF, as float tensors or packed for a
quantized kernel (quant.py); see `linear` for how they are applied. The MLP of a layer is
pluggable: MoE models (moe_model.py) put a MoE block there.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.model.arch import ModelArch
from pdserve.model.attention import AttentionMetadata, DecodeKernel, paged_attention, prefill_plan
from pdserve.model.kernels.decode_attention import decode_attention_kernel
from pdserve.model.kernels.layer import FusedLayer, FusedStack, FusedStep, prefill_rows, rope_rows, silu_mul
from pdserve.model.kernels.norm import native_rms_norm
from pdserve.model.kernels.prefill_attention import PrefillAttention, prefill_attention_kernel
from pdserve.model.kernels.qgemm import TiledFloat
from pdserve.model.linear import linear
from pdserve.model.quant import QuantizedWeight, cat_rows, pack, weight_nbytes
from pdserve.model.rotary import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # Rows of the residual stream: one native pass a row (torch's runs ~7 small ops, ~70 us each
        # call at decode sizes, 60 calls a step). Else torch's fused form, bit for bit the formula below.
        out = native_rms_norm(x, weight, eps)
        return out if out is not None else F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DenseMLP:
    """SwiGLU: down(silu(gate(h)) * up(h)), gate and up fused."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up = torch.cat([gate, up], 0)
        self.down = down.contiguous()

    @classmethod
    def packed(cls, gate_up, down) -> DenseMLP:
        """From weights already fused and packed (float tensors or QuantizedWeight, see quant.py)."""
        mlp = cls.__new__(cls)
        mlp.gate_up, mlp.down = gate_up, down
        return mlp

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gu = linear(h, self.gate_up)
        act = silu_mul(gu)  # the fused decode layer's own (layer.c), so both paths match bit for bit
        if act is None:
            gate, up = gu.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return linear(act, self.down)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.gate_up, self.down]


class DecoderLayer:
    def __init__(self, arch: ModelArch, w: dict, mlp: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """`w`: norms and biases as float tensors; `qkv` (fused) and `o_proj` as the model packed them."""
        self.arch = arch
        self.input_norm = w["input_layernorm"]
        self.post_norm = w["post_attention_layernorm"]
        self.qkv = w["qkv"]
        self.qkv_bias = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]]) if "q_bias" in w else None
        self.q_norm, self.k_norm = w.get("q_norm"), w.get("k_norm")
        self.o = w["o_proj"]
        self.mlp = mlp
        self.decode_kernel: DecodeKernel | None = None  # set by the model (attention_kernel)
        self.prefill_kernel: PrefillAttention | None = None  # likewise

    def attention_weights(self) -> list:
        return [self.qkv, self.o]

    def attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x plus the attention output (the residual stream after the attention half)."""
        a = self.arch
        h = rms_norm(x, self.input_norm, a.rms_norm_eps)
        qkv = linear(h, self.qkv)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        t = x.shape[0]
        if self.q_norm is None:
            # q and k heads side by side in qkv's rows: one rotary pass over both halves the small ops.
            qk = qkv[:, : a.q_size + a.kv_size].view(t, a.num_heads + a.num_kv_heads, a.head_dim)
            if not rope_rows(qk, cos, sin):  # in place where the kernel runs (qkv is this step's own)
                qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        else:
            q, k = (
                qkv[:, : a.q_size].view(t, a.num_heads, a.head_dim),
                qkv[:, a.q_size : a.q_size + a.kv_size],
            )
            q, k = (
                rms_norm(q, self.q_norm, a.rms_norm_eps),
                rms_norm(k.view(t, a.num_kv_heads, a.head_dim), self.k_norm, a.rms_norm_eps),
            )
            if not rope_rows(q, cos, sin):  # the norms' outputs: in place where the kernel runs
                q = apply_rotary(q, cos, sin)
            if not rope_rows(k, cos, sin):
                k = apply_rotary(k, cos, sin)
        v = qkv[:, a.q_size + a.kv_size :].reshape(t, a.num_kv_heads, a.head_dim)
        o = paged_attention(
            q, k, v, k_cache, v_cache, meta, a.head_dim**-0.5, self.decode_kernel, self.prefill_kernel
        )
        return x + linear(o.reshape(t, a.q_size), self.o)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.attention(x, cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(rms_norm(x, self.post_norm, self.arch.rms_norm_eps))


def _read_for(w: Mapping[str, Any], source: Mapping[str, Any], name: str, mode: str) -> Any:
    """w[name] to be packed for `mode`: a checkpoint on disk (hf_files.HFWeights) quantizes a large
    matrix as it reads its rows, so the output head is never whole in its stored dtype beside its
    quantized copy (the largest transient of loading a quantized model)."""
    quantized = getattr(source, "quantized", None)
    if mode != "none" and quantized is not None:
        staged = quantized(name, mode)
        if staged is not None:
            return staged
    return w[name]


class LlamaModel:
    """Holds the weights; `forward` runs one engine step over flattened tokens."""

    def __init__(
        self,
        arch: ModelArch,
        weights: dict,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        quantization: str = "none",
        attention_kernel: str = "auto",
        gemm_kernel: str = "auto",
        activation_quantization: str = "none",
    ) -> None:
        """`weights`: float tensors in HF naming; with `quantization`, the linear layers' matrices may
        come already quantized from the file (quant.Staged) and every one is packed for its kernel.
        `activation_quantization` (model.activation_quantization): "int8" gives every int4 and int8
        product int8 activations (kernels/qgemm_q8.c), the fused decode layer's and the head's included."""
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        self.native_gemm = gemm_kernel == "auto"
        self.activation_quantization = activation_quantization
        big = {
            k
            for k in weights
            if k.endswith("_proj.weight") or k in ("lm_head.weight", "model.embed_tokens.weight")
        }
        # Norms and biases converted now; each matrix is taken from `weights` as it is packed, so a mapping
        # that reads from disk (hf_files.HFWeights) has one in memory at a time.
        small = {k: weights[k].to(dtype=dtype, device=self.device) for k in weights if k not in big}
        w = ChainMap(small, weights)
        pack = self._pack
        head_key = "lm_head.weight" if "lm_head.weight" in w and not arch.tie_word_embeddings else None
        # The (tied) embedding is int8 when quantized: the output head runs the int8 kernel and the
        # embedding lookup dequantizes the few rows it reads; int4's groups would cost more than they save there.
        qhead = "none" if quantization == "none" else "int8"
        embed_mode = qhead if head_key is None else "none"
        self.embed = pack(_read_for(w, weights, "model.embed_tokens.weight", embed_mode), embed_mode)
        self.lm_head = self.embed if head_key is None else pack(_read_for(w, weights, head_key, qhead), qhead)
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            if arch.is_mla:  # DeepSeek's latent attention (mla.py imports this module)
                from pdserve.model.mla import MLALayer

                self.layers.append(MLALayer(arch, w, p, pack, self._build_mlp(i, w), dtype, self.device))
                continue
            lw = {
                "input_layernorm": w[p + "input_layernorm.weight"],
                "post_attention_layernorm": w[p + "post_attention_layernorm.weight"],
                "o_proj": pack(w[p + "self_attn.o_proj.weight"]),
                "qkv": pack(cat_rows([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], quantization)),
            }
            for n in ("q", "k", "v"):
                if p + f"self_attn.{n}_proj.bias" in w:
                    lw[f"{n}_bias"] = w[p + f"self_attn.{n}_proj.bias"]
            if arch.qk_norm:
                lw["q_norm"], lw["k_norm"] = (
                    w[p + "self_attn.q_norm.weight"],
                    w[p + "self_attn.k_norm.weight"],
                )
            self.layers.append(DecoderLayer(arch, lw, self._build_mlp(i, w)))
        self.max_model_len = max_model_len or arch.max_position_embeddings
        self.rotary = RotaryEmbedding(
            arch.rope_dim, arch.rope_theta, self.max_model_len, arch.rope_scaling, dtype, self.device
        )
        self.decode_kernel = None
        self.prefill_kernel = None
        if attention_kernel == "auto" and self.device.type == "cpu" and dtype == torch.float32:
            self.decode_kernel = decode_attention_kernel()
            self.prefill_kernel = prefill_attention_kernel(arch.sliding_window)
        for layer in self.layers:
            layer.decode_kernel = self.decode_kernel
            layer.prefill_kernel = self.prefill_kernel
        self.fused = self._fuse() if self.decode_kernel is not None else None

    def _fuse(self) -> FusedStack | None:
        """Every layer as layer.c runs it in a decode-only step, or None where one cannot (q/k norms,
        a MoE block, a product that does not run qgemm.c)."""
        fused = []
        if self.arch.is_mla:
            return None
        for layer in self.layers:
            mlp = layer.mlp
            f = None
            if layer.q_norm is None and isinstance(mlp, DenseMLP):
                f = FusedLayer.of(
                    self.arch,
                    layer.qkv,
                    layer.o,
                    mlp.gate_up,
                    mlp.down,
                    layer.input_norm,
                    layer.post_norm,
                    layer.qkv_bias,
                )
            if f is None:
                return None
            fused.append(f)
        return FusedStack(fused) if fused else None

    def _pack(self, w, mode: str | None = None):
        return pack(
            w,
            self.quantization if mode is None else mode,
            self.dtype,
            self.device,
            self.native_gemm,
            self.activation_quantization,
        )

    def _build_mlp(self, i: int, w: dict) -> Callable[[torch.Tensor], torch.Tensor]:
        p = f"model.layers.{i}.mlp."
        gate_up = cat_rows([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]], self.quantization)
        return DenseMLP.packed(self._pack(gate_up), self._pack(w[p + "down_proj.weight"]))

    def _weights(self) -> list:
        tensors = [t for t in (self.lm_head, self.norm) if t is not None]
        for layer in self.layers:
            tensors += [
                *layer.attention_weights(),
                *layer.mlp.weight_tensors(),
                layer.input_norm,
                layer.post_norm,
            ]
        return tensors

    def weight_bytes(self) -> int:
        """Bytes read by one decode step: one layout of each weight (the embedding lookup reads a few rows)."""
        return sum(weight_nbytes(t) for t in self._weights())

    def resident_weight_bytes(self) -> int:
        """Bytes the weights hold in memory (the embedding too when it is not the output head)."""
        extra = [] if self.embed is self.lm_head else [self.embed]
        return sum(weight_nbytes(t, resident=True) for t in self._weights() + extra)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, (QuantizedWeight, TiledFloat)):
            return self.embed.rows(input_ids, self.dtype)
        return self.embed[input_ids]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_indices: torch.Tensor | None,
        layer_done: Callable[[int], None] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor | None:
        """kv_cache: arch.kv_cache_shape(slots) ([layers, 2, slots, kv_heads, head_dim], or one latent
        plane with MLA). Returns float32 logits [len(logits_indices), V]
        (None without logits_indices: expert-parallel ranks other than 0 need no logits); with
        `head` False the final-normed rows [len(logits_indices), hidden] instead, for `head()` later.
        `layer_done(i)` runs once layer i's KV is written (a prefill worker ships it while i+1 computes).
        `inputs_embeds` [tokens, hidden] replaces the embedding lookup (a VLM's image rows, model/vlm.py)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.tables(positions)
        n = x.shape[0]
        if self.fused is not None and FusedStep.applies(meta, n, self.fused_prefill_rows()):
            step = self.fused_step(meta, cos, sin, n)
            x = x.contiguous() if inputs_embeds is None else x.clone(memory_format=torch.contiguous_format)
            if layer_done is None:
                step.run_all(self.fused, x, kv_cache)  # x in place
            else:
                for i, f in enumerate(self.fused.layers):
                    step.run(f, x, kv_cache[i, 0], kv_cache[i, 1])
                    layer_done(i)
        else:
            for i, layer in enumerate(self.layers):
                # K and V planes; MLA's one latent plane comes as both (its layer reads the first).
                x = layer.forward(x, cos, sin, kv_cache[i, 0], kv_cache[i, -1], meta)
                if layer_done is not None:
                    layer_done(i)
        if logits_indices is None:
            return None
        x = rms_norm(x[logits_indices], self.norm, self.arch.rms_norm_eps)
        return self.head(x) if head else x

    def fused_prefill_rows(self) -> int:
        """The most rows of a step with prefill chunks that layer.c runs (0: none, without the prefill
        kernel for this model's heads)."""
        kernel = self.prefill_kernel
        if self.fused is None or kernel is None or not kernel.takes(self.arch.head_dim):
            return 0
        return prefill_rows(self.fused)

    def fused_step(self, meta: AttentionMetadata, cos: torch.Tensor, sin: torch.Tensor, n: int) -> FusedStep:
        """The step's inputs for layer.c (FusedStep.applies said it runs there), its chunks' plan included."""
        assert self.fused is not None
        plan = prefill_plan(meta, self.prefill_kernel) if meta.prefills and self.prefill_kernel else None
        return FusedStep(meta, cos, sin, n, self.fused, plan, self.arch.sliding_window or 0)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed rows [n, hidden]."""
        if self.lm_head is None:
            raise RuntimeError("this model's output head was dropped (an expert-parallel rank other than 0)")
        return linear(x, self.lm_head).float()

    def drop_head(self) -> None:
        """Let the output head go where logits are never computed here (expert-parallel ranks of other
        hosts: rank 0 runs the head over every rank's rows); a tied head stays, as the embedding."""
        if self.lm_head is not self.embed:
            self.lm_head = None
