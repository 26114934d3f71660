"""Mixture-of-experts block: a top-k gate, routed SwiGLU experts held in physical slots, shared experts.

Routing follows each family's reference: softmax (Mixtral, Qwen-MoE, DeepSeek-V2) or sigmoid scoring
(DeepSeek-V3), optional group-limited choice (V2 keeps the groups with the best expert, V3 the groups
with the best two after adding a correction bias), optional renormalisation and a scaling factor.

Experts live in physical slots (`LayerPlacement`): slot s holds logical expert `phy2log[s]`, hot experts
may have several slots (replicas), and an expert-parallel rank holds only the slots `lo..hi` of its
slice. A block computes the choices that land in its slots and returns that partial sum; `combine`
(an all-reduce under expert parallelism) adds up the ranks' parts. With one rank and no replicas the
slots are the logical experts and nothing is dispatched.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pdserve.eplb.dispatch import dispatch_by_load, own_tokens
from pdserve.eplb.placement import LayerPlacement
from pdserve.model.arch import ModelArch
from pdserve.model.experts import ExpertSource, ExpertStack
from pdserve.model.hf_files import HFWeights
from pdserve.model.kernels.layer import silu_mul
from pdserve.model.kernels.moe import grouped_moe
from pdserve.model.quant import Staged


def select_experts(
    logits: torch.Tensor, arch: ModelArch, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (float32) -> (weights [T, k] float32, logical expert ids [T, k])."""
    k, e = arch.num_experts_per_tok, arch.num_experts
    scores = logits.softmax(-1) if arch.scoring_func == "softmax" else logits.sigmoid()
    # The correction bias steers the choice only; the weights come from the unbiased scores.
    choice = scores + bias if bias is not None and arch.topk_method == "noaux_tc" else scores
    if arch.topk_method in ("group_limited_greedy", "noaux_tc") and arch.n_group > 1:
        grouped = choice.view(-1, arch.n_group, e // arch.n_group)
        if arch.topk_method == "group_limited_greedy":
            group_score = grouped.amax(-1)
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_score.topk(arch.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // arch.n_group, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if arch.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * arch.routed_scaling_factor, ids


def routed_experts(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pl: LayerPlacement
) -> torch.Tensor:
    """Sum over the choices that land in this rank's slots of weight * expert(x): [T, H]. Every active
    expert in one native call (kernels/moe.c) where the weights are in its tile layout and the
    activations float32 on CPU, else slot by slot (`routed_experts_loop`, the same values)."""
    gu, down = pl.gate_up, pl.down
    if x.dtype == torch.float32 and x.device.type == "cpu" and gu.kernel_ready() and down.kernel_ready():
        x = x if x.stride(1) == 1 else x.contiguous()
        return grouped_moe(x, slots, weights, pl.lo, pl.hi, gu.kernel_struct(), down.kernel_struct())
    return routed_experts_loop(x, slots, weights, pl)


def routed_experts_loop(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pl: LayerPlacement
) -> torch.Tensor:
    """`routed_experts` op by op: tokens grouped by slot (one sort), each active slot runs one pair of
    products over its tokens, and the results go back with one index_add."""
    out = torch.zeros_like(x)
    k = slots.shape[1]
    flat = slots.reshape(-1)
    if pl.lo > 0 or pl.hi < pl.phy2log.numel():
        pos = ((flat >= pl.lo) & (flat < pl.hi)).nonzero().squeeze(1)
        pos = pos[torch.argsort(flat[pos], stable=True)]
    else:
        pos = torch.argsort(flat, stable=True)
    if pos.numel() == 0:
        return out
    tok = pos // k
    counts = torch.bincount(flat[pos] - pl.lo, minlength=pl.hi - pl.lo).tolist()
    xs = x.index_select(0, tok)
    ys = torch.empty_like(xs)
    start = 0
    for s, n in enumerate(counts):
        if n == 0:
            continue
        gu = pl.gate_up.matmul(s, xs[start : start + n])
        act = silu_mul(gu)  # moe.c's own (layer.c), so both paths match bit for bit
        if act is None:
            gate, up = gu.chunk(2, dim=-1)
            act = F.silu(gate) * up
        ys[start : start + n] = pl.down.matmul(s, act)
        start += n
    ys *= weights.reshape(-1)[pos].unsqueeze(1)
    return out.index_add_(0, tok, ys)


def _exact_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for the router's small products, summed in float64 and rounded to float32: torch's
    float32 product gave other bits on one thread and on two at some row counts (5 rows, say), and a
    worker's thread count changes (utils/core_share.py) while its choice of experts must not. The
    float64 sums' own last-bit differences vanish in the rounding (but for a sum within 2^-29 of a
    float32 rounding boundary)."""
    return F.linear(x.double(), w.double()).float()


class MoEBlock:
    """The MLP of a MoE layer: callable on the post-attention normed hidden states [T, H]."""

    def __init__(
        self,
        arch: ModelArch,
        layer: int,
        gate: torch.Tensor,
        bias: torch.Tensor | None,
        placement: LayerPlacement,
        shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
        shared_gate: torch.Tensor | None = None,
        rank: int = 0,
        world: int = 1,
        combine: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.arch, self.layer = arch, layer
        self.gate = gate.float()  # routing in float32 whatever the model dtype, as the references do
        self.bias = bias.float() if bias is not None else None
        if isinstance(placement.gate_up, torch.Tensor):  # float stacks [E, N, K] given as they are
            placement = dataclasses.replace(
                placement,
                gate_up=ExpertStack.plain(placement.gate_up),
                down=ExpertStack.plain(placement.down),
            )
        self.placement = placement
        self.shared, self.shared_gate = shared, shared_gate
        self.rank, self.world, self.combine = rank, world, combine
        # Data-parallel attention (ep_exchange.py): set for the steps whose tokens are this rank's own.
        self.exchange: Callable[..., torch.Tensor] | None = None
        # Called with (layer, logical topk ids) every forward: the EPLB recorder's feed.
        self.expert_load_hook: Callable[[int, torch.Tensor], None] | None = None
        self.step_offset = 0  # the step number, set by the model before each step

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(_exact_linear(h, self.gate), self.arch, self.bias)
        if self.expert_load_hook is not None:
            self.expert_load_hook(self.layer, ids)
        pl = self.placement  # read once: a swap can only happen between steps
        # Replicas by load: the same batch and placement give the same slots on every rank.
        slots = ids if pl.identity or not ids.numel() else dispatch_by_load(ids, pl.table, self.world)
        if self.exchange is not None:
            # h holds this rank's own tokens: their choices elsewhere travel, the shared expert runs on all.
            out = self.exchange(
                h, slots, weights, pl, lambda x, s, w: routed_experts(x, s, w.to(x.dtype), pl)
            )
            lo, hi = 0, h.shape[0]
        else:
            out = routed_experts(h, slots, weights.to(h.dtype), pl)
            # Each rank runs the shared expert on its own slice of the tokens; the combine sums them.
            lo, hi = own_tokens(h.shape[0], self.rank, self.world)
        if self.shared is not None and hi > lo:
            s = self.shared(h[lo:hi])
            if self.shared_gate is not None:
                s = torch.sigmoid(_exact_linear(h[lo:hi], self.shared_gate).to(s.dtype)) * s
            out[lo:hi] += s
        if self.exchange is None and self.combine is not None:
            out = self.combine(out)
        return out

    def weight_tensors(self) -> list[torch.Tensor]:
        extra = self.shared.weight_tensors() if self.shared is not None else []
        pl = self.placement
        return [self.gate, *pl.gate_up.tensors, *pl.down.tensors, *extra]


# ---------------------------------------------------------------- checkpoint names

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_keys(layer: int) -> tuple[str, str]:
    """Our names of a layer's stacked expert weights: gate_up [E, 2I, H] and down [E, H, I]."""
    p = f"model.layers.{layer}.mlp.experts."
    return p + "gate_up", p + "down"


def _canonical_names(
    names: Iterable[str], arch: ModelArch
) -> tuple[dict[str, str], dict[str, str], dict[int, list[dict[str, str]]]]:
    """A checkpoint's names sorted out: (our name -> its name for every tensor but the experts; our
    stacked expert key -> its fused 3-D tensor; MoE layer -> each expert's gate_proj / up_proj /
    down_proj names), for the layers whose experts are stored one by one."""
    plain: dict[str, str] = {}
    fused: dict[str, str] = {}
    per: dict[tuple[int, int], dict[str, str]] = {}
    for name in names:
        n = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        m = _EXPERT.match(n)
        if m:
            per.setdefault((int(m[1]), int(m[2])), {})[_MIXTRAL.get(m[3], m[3])] = name
            continue
        m = _FUSED.match(n)
        if m:
            fused[expert_keys(int(m[1]))[0 if m[2] == "gate_up_proj" else 1]] = name
            continue
        plain[n] = name
    layers: dict[int, list[dict[str, str]]] = {}
    for layer in arch.moe_layer_ids():
        if expert_keys(layer)[0] in fused:
            continue
        try:
            layers[layer] = [per.pop((layer, e)) for e in range(arch.num_experts)]
            for x in layers[layer]:
                x["gate_proj"], x["up_proj"], x["down_proj"]  # noqa: B018 - each present
        except KeyError as exc:
            raise ValueError(f"layer {layer}: missing weights of expert {exc} in the checkpoint") from None
    return plain, fused, layers


def canonical_moe_weights(weights: Mapping[str, torch.Tensor], arch: ModelArch) -> Mapping[str, Any]:
    """Rename a MoE checkpoint to our names and stack each layer's experts.

    Accepts Mixtral's `block_sparse_moe.experts.N.w1/w2/w3`, the `mlp.experts.N.gate_proj/up_proj/
    down_proj` of Mixtral, Qwen-MoE and DeepSeek, and transformers 5's fused 3-D
    `mlp.experts.gate_up_proj/down_proj`; `shared_experts` (DeepSeek) becomes `shared_expert` (Qwen).
    Weights in memory are stacked here; a checkpoint on disk (hf_files.HFWeights) stays there: its
    experts come as `ExpertSource`s that the model packs expert by expert (`StreamedMoEWeights`)."""
    if isinstance(weights, HFWeights):
        return StreamedMoEWeights(weights, arch)
    plain, fused, layers = _canonical_names(weights, arch)
    out = {n: weights[src] for n, src in plain.items()}
    out.update({k: weights[src] for k, src in fused.items()})
    for layer, experts in layers.items():
        gu_key, down_key = expert_keys(layer)
        out[gu_key] = torch.stack(
            [torch.cat([weights[x["gate_proj"]], weights[x["up_proj"]]]) for x in experts]
        )
        out[down_key] = torch.stack([weights[x["down_proj"]] for x in experts])
    return out


class StreamedMoEWeights(Mapping[str, Any]):
    """A MoE checkpoint on disk in our names: a tensor read on each access (hf_files.HFWeights), a layer's
    stacked experts an `ExpertSource` that reads one expert at a time (its gate and up rows
    concatenated, as the stack holds them)."""

    def __init__(self, hf: HFWeights, arch: ModelArch) -> None:
        self.hf = hf
        plain, fused, layers = _canonical_names(hf, arch)
        self._plain = plain
        self._experts: dict[str, ExpertSource] = {}
        for key, src in fused.items():
            self._experts[key] = ExpertSource(hf.stored(src).shape, functools.partial(hf.read_index, src))
        for layer, experts in layers.items():
            gu_key, down_key = expert_keys(layer)
            g, d = hf.stored(experts[0]["gate_proj"]).shape, hf.stored(experts[0]["down_proj"]).shape
            self._experts[gu_key] = ExpertSource(
                (len(experts), 2 * g[0], g[1]),
                lambda i, x=experts: torch.cat([hf[x[i]["gate_proj"]], hf[x[i]["up_proj"]]]),
            )
            self._experts[down_key] = ExpertSource(
                (len(experts), *d), lambda i, x=experts: hf[x[i]["down_proj"]]
            )

    def __getitem__(self, name: str) -> Any:
        if name in self._experts:
            return self._experts[name]
        return self.hf[self._plain[name]]

    def __iter__(self) -> Iterator[str]:
        yield from self._plain
        yield from self._experts

    def __len__(self) -> int:
        return len(self._plain) + len(self._experts)

    def __contains__(self, name: object) -> bool:
        return name in self._plain or name in self._experts

    def quantized(self, name: str, mode: str) -> Staged | None:
        """hf_files.HFWeights.quantized, in our names (None for the experts)."""
        return self.hf.quantized(self._plain[name], mode) if name in self._plain else None

    def digest(self) -> str:
        """The checkpoint's (hf_files.HFWeights.digest)."""
        return self.hf.digest()
