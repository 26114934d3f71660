"""MoE decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3 with standard attention, dots1).

The same decoder as llama.py with a MoE block as the MLP of the MoE layers. The full expert weights
stay where the loader put them (host memory, shared between expert-parallel ranks on one host): they
are the source the weight mover copies from, unless the ranks span hosts (then each rank keeps only
its slots, `keep_own_experts`). A rank's device holds only its physical slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any, Callable

import torch

from pdserve.eplb.placement import LayerPlacement, slot_range
from pdserve.model.arch import ModelArch
from pdserve.model.experts import ExpertStack
from pdserve.model.kernels.layer import FusedLayer, FusedStep
from pdserve.model.llama import DenseMLP, LlamaModel, rms_norm
from pdserve.model.moe import MoEBlock, expert_keys
from pdserve.model.quant import cat_rows


def initial_placement(arch: ModelArch, num_physical: int, num_ranks: int) -> torch.Tensor:
    """[moe layers, P]: every expert once, the redundant slots to the first experts, as the policy
    places uniform load (replicas of one expert on different ranks)."""
    from pdserve.eplb.policy import rebalance_experts

    layers = len(arch.moe_layer_ids())
    if num_physical == arch.num_experts:
        return torch.arange(arch.num_experts).repeat(layers, 1)
    return rebalance_experts(torch.ones(layers, arch.num_experts), num_physical, num_ranks)


class MoEModel(LlamaModel):
    """`phy2log` [moe layers, P] is the placement in force; this rank holds slots `slot_range(P, rank, world)`.
    `combine` adds up the ranks' partial MoE outputs (None with one rank)."""

    def __init__(
        self,
        arch: ModelArch,
        weights: Mapping[str, Any],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        *,
        phy2log: torch.Tensor | None = None,
        rank: int = 0,
        world: int = 1,
        combine: Callable[[torch.Tensor], torch.Tensor] | None = None,
        quantization: str = "none",
        attention_kernel: str = "auto",
        gemm_kernel: str = "auto",
        activation_quantization: str = "none",
    ) -> None:
        """`quantization` applies to the experts as to every linear layer (quant.py's formats); the
        experts may come packed already (`pack_experts`, shared between ranks).
        `activation_quantization` too (LlamaModel's), the experts' products included."""
        self.moe_ids = arch.moe_layer_ids()
        keys = {k for i in self.moe_ids for k in expert_keys(i)}
        # Host copies in their packed format: the mover's source.
        native = gemm_kernel == "auto" and torch.device(device).type == "cpu"
        packed = pack_experts(weights, arch, quantization, dtype, native)
        packed = {k: v.with_activations(activation_quantization) for k, v in packed.items()}
        self.expert_store: list[tuple[ExpertStack, ...]] | None = [
            tuple(packed[k] for k in expert_keys(i)) for i in self.moe_ids
        ]
        self.phy2log = (
            phy2log if phy2log is not None else initial_placement(arch, arch.num_experts, world)
        ).long()
        self.rank, self.world, self._combine = rank, world, combine
        self._raw = weights
        self.blocks: list[MoEBlock] = []
        super().__init__(
            arch,
            _Without(weights, keys),  # read as the layers are built, where a checkpoint streams
            dtype,
            device,
            max_model_len,
            quantization,
            attention_kernel,
            gemm_kernel,
            activation_quantization,
        )
        del self._raw

    def _fuse(self) -> _MoEFused | None:  # type: ignore[override]
        """A decode-only step's layers through layer.c: dense layers whole, MoE layers their attention
        half, with the MoE block between the calls. None where a layer cannot (q/k norms, MLA, a product
        outside qgemm.c)."""
        if self.arch.is_mla:
            return None
        layers, blocks, keep = [], [], []
        for layer in self.layers:
            mlp = layer.mlp
            dense = isinstance(mlp, DenseMLP)
            # layer.c keeps the norms' addresses: copies of its own, since the loader's tensors (which
            # the layer may hold as they are) move when an expert-parallel model shares them.
            norms = (layer.input_norm.clone(), layer.post_norm.clone())
            f = None
            if layer.q_norm is None:
                f = FusedLayer.of(
                    self.arch,
                    layer.qkv,
                    layer.o,
                    mlp.gate_up if dense else None,
                    mlp.down if dense else None,
                    *norms,
                    layer.qkv_bias,
                )
            if f is None:
                return None
            layers.append(f)
            blocks.append(None if dense else mlp)
            keep += norms
        return _MoEFused(layers, blocks, keep) if layers else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta,
        kv_cache: torch.Tensor,
        logits_indices: torch.Tensor | None,
        layer_done: Callable[[int], None] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor | None:
        """LlamaModel's step; a step of decodes (and prefill chunks within fused_prefill_rows) runs each
        layer's attention in layer.c (the same values as op by op, bit for bit) and each MoE block
        between those calls."""
        fused = self.fused
        n = input_ids.shape[0] if inputs_embeds is None else inputs_embeds.shape[0]
        if fused is None or not FusedStep.applies(meta, n, self.fused_prefill_rows()):  # then op by op
            return super().forward(
                input_ids, positions, meta, kv_cache, logits_indices, layer_done, inputs_embeds, head
            )
        # layer.c updates the rows in place: a copy of the caller's embeddings.
        x = self.embed_tokens(input_ids).contiguous() if inputs_embeds is None else inputs_embeds.clone()
        cos, sin = self.rotary.tables(positions)
        step = self.fused_step(meta, cos, sin, n)
        eps = self.arch.rms_norm_eps
        for i, (f, block) in enumerate(zip(fused.layers, fused.blocks)):
            step.run(f, x, kv_cache[i, 0], kv_cache[i, 1])
            if block is not None:
                x = x + block(rms_norm(x, self.layers[i].post_norm, eps))
            if layer_done is not None:
                layer_done(i)
        if logits_indices is None:
            return None
        x = rms_norm(x[logits_indices], self.norm, eps)
        return self.head(x) if head else x

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    def local_placement(self, j: int, phy2log: torch.Tensor) -> LayerPlacement:
        """The placement of MoE layer j for this rank, its slots copied from the host store, or on the
        host a view of it when the slots hold a run of consecutive experts (the initial placement):
        then the experts are in memory once, whatever the number of ranks."""
        lo, hi = slot_range(phy2log.numel(), self.rank, self.world)
        assert self.expert_store is not None, "placements are built from the host copy"
        gate_up, down = self.expert_store[j]
        ids = phy2log[lo:hi]
        first = int(ids[0]) if ids.numel() else 0
        if gate_up.device == self.device and torch.equal(ids, torch.arange(first, first + ids.numel())):
            local = gate_up[first : first + ids.numel()], down[first : first + ids.numel()]
        else:
            local = gate_up[ids].to(self.device), down[ids].to(self.device)
        return LayerPlacement.build(phy2log, self.arch.num_experts, lo, hi, *local)

    def _build_mlp(self, i: int, w: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        if i not in self.moe_ids:
            return super()._build_mlp(i, w)
        j, p, a = len(self.blocks), f"model.layers.{i}.mlp.", self.arch
        shared = None
        if a.shared_expert_intermediate_size:
            s = p + "shared_expert."
            gate_up = cat_rows([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]], self.quantization)
            shared = DenseMLP.packed(self._pack(gate_up), self._pack(w[s + "down_proj.weight"]))
        raw = self._raw
        bias = raw.get(p + "gate.e_score_correction_bias")
        block = MoEBlock(
            a,
            i,
            raw[p + "gate.weight"].to(self.device, torch.float32),
            bias.to(self.device) if bias is not None else None,
            self.local_placement(j, self.phy2log[j]),
            shared,
            w.get(p + "shared_expert_gate.weight"),
            self.rank,
            self.world,
            self._combine,
        )
        self.blocks.append(block)
        return block

    def keep_own_experts(self) -> None:
        """Hold only this rank's slots (ranks that span hosts): each layer's slots become copies of
        their own, and the host copy of every expert goes (new experts then come from the ranks
        holding them, model/ep_fetch.py)."""
        for b in self.blocks:
            p = b.placement
            own = torch.arange(len(p.gate_up))
            b.placement = replace(p, gate_up=p.gate_up[own], down=p.down[own])
        self.expert_store = None

    def set_exchange(self, exchange: Callable[..., torch.Tensor] | None) -> None:
        """Data-parallel attention's row exchange for the MoE blocks (None: the combine's all-reduce)."""
        for b in self.blocks:
            b.exchange = exchange

    def idle_step(self) -> None:
        """A step in which this rank has no sequence: it still takes part in every MoE layer's exchange,
        in order, computing the rows the other ranks send it."""
        empty = torch.zeros(0, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        for b in self.blocks:
            b(empty)

    def set_step(self, step: int) -> None:
        for b in self.blocks:
            b.step_offset = step

    def set_load_hook(self, hook: Callable[[int, torch.Tensor], None] | None) -> None:
        for b in self.blocks:
            b.expert_load_hook = hook


class _Without(Mapping[str, Any]):
    """`weights` but `keys`, each value read when asked for (a dict comprehension would read every
    tensor of a checkpoint on disk at once)."""

    def __init__(self, weights: Mapping[str, Any], keys: set[str]) -> None:
        self._weights, self._keys = weights, keys

    def __getitem__(self, name: str) -> Any:
        if name in self._keys:
            raise KeyError(name)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._weights if k not in self._keys)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return name not in self._keys and name in self._weights

    def quantized(self, name: str, mode: str) -> Any:
        """The source's `quantized` (hf_files.HFWeights.quantized) where it has one, else None."""
        quantized = getattr(self._weights, "quantized", None)
        return None if quantized is None or name in self._keys else quantized(name, mode)


class _MoEFused:
    """The layers of a MoE model's decode-only step as layer.c runs them, and the MoE block after each
    attention-only layer (None after a dense one)."""

    def __init__(
        self, layers: list[FusedLayer], blocks: list[MoEBlock | None], keep: list[torch.Tensor]
    ) -> None:
        self.layers, self.blocks, self._keep = layers, blocks, keep
        self.scratch_per_row = max(f.scratch_per_row for f in layers)
        self.own_per_row = max(f.own_per_row for f in layers)


def pack_experts(
    weights: Mapping[str, Any], arch: ModelArch, mode: str, dtype: torch.dtype, native: bool
) -> dict[str, ExpertStack]:
    """Every MoE layer's stacked experts packed for `mode` (experts.py), on the host; stacks packed
    already are kept, and a checkpoint's (experts.ExpertSource) are read and packed expert by expert."""
    out = {}
    for i in arch.moe_layer_ids():
        for k in expert_keys(i):
            w = weights[k]
            out[k] = w if isinstance(w, ExpertStack) else ExpertStack.pack(w, mode, dtype, "cpu", native)
    return out


def tiny_moe_weights(arch: ModelArch, layer: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights of one MoE layer in our names (loader.tiny_random_weights does the rest)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / (shape[-1] ** 0.5)

    h, e, i = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
    p = f"model.layers.{layer}.mlp."
    gate_up, down = expert_keys(layer)
    # A router scaled up a little so that choices are clear-cut rather than near ties.
    w = {p + "gate.weight": rand(e, h) * 4, gate_up: rand(e, 2 * i, h), down: rand(e, h, i)}
    if arch.topk_method == "noaux_tc":
        w[p + "gate.e_score_correction_bias"] = torch.randn(e, generator=g) * 0.1
    if arch.shared_expert_intermediate_size:
        si = arch.shared_expert_intermediate_size
        w.update(
            {
                p + "shared_expert.gate_proj.weight": rand(si, h),
                p + "shared_expert.up_proj.weight": rand(si, h),
                p + "shared_expert.down_proj.weight": rand(h, si),
            }
        )
        if arch.shared_expert_gate:
            w[p + "shared_expert_gate.weight"] = rand(1, h)
    return w
