"""A step's layers through layer.c (its decodes, and its prefill chunks up to FUSED_PREFILL_BYTES),
one native call for the whole stack (or one a layer where the caller acts between layers; see the C
file for why), and the SiLU * up and rotary pass that the op-by-op path shares with it."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Protocol

import torch

from pdserve.model.kernels.decode_attention import kv_bf16
from pdserve.model.kernels.native import function, ptr

_I, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
MAX_GROUPS = 4  # pd_step's groups (attention.MAX_DECODE_GROUPS)
# The most scratch a step with prefill chunks may take in layer.c (every row's intermediate values at
# once): a prompt's step spends less there than in the op-by-op path's dispatch until its scratch
# outgrows the caches and the misses cost more than the dispatch saves. Where that happens depends on
# the model's widths, hence a bound in bytes, and on the machine (docs/benchmarks.md: the crossover
# measured on an Intel Xeon with AMX). 32 MB is also glibc's largest mmap threshold (utils/runtime.py),
# below which a step's scratch comes back from the heap instead of fresh pages.
FUSED_PREFILL_BYTES = 32 << 20


class Weight(ctypes.Structure):
    _fields_ = [("bits", _I), ("n", _I), ("k", _I), ("w", _P), ("d", _P), ("m", _P)]


class Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", Weight),
        ("o", Weight),
        ("gate_up", Weight),
        ("down", Weight),
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv_bias", _P),
        ("eps", _F),
        ("scale", _F),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("inter", _I),
    ]


class Group(ctypes.Structure):
    _fields_ = [("start", _I), ("n", _I), ("tstride", _I64), ("table", _P), ("first", _P), ("ctx", _P)]


class Step(ctypes.Structure):
    _fields_ = [
        ("n", _I),
        ("block_size", _I),
        ("ngroups", _I),
        ("threads", _I),
        ("kv_bf16", _I),
        ("cos", _P),
        ("sin", _P),
        ("slots", _P),
        ("scratch", _P),
        ("groups", Group * MAX_GROUPS),
        ("pf_desc", _P),
        ("pf_tables", _P),
        ("nchunks", _I),
        ("window", _I64),
    ]


@lru_cache(maxsize=1)
def _fns():
    layer = function("layer", "pd_decode_layer", [_P, _P, _P, _P, _P])
    if layer is None:
        return None
    return (
        layer,
        function("layer", "pd_silu_mul", [_P, _I64, _P, _I64, _I, _I, _I]),
        function("layer", "pd_decode_layers", [_P, _I, _P, _P, _P, _I64, _I64]),
        function("layer", "pd_rope_rows", [_P, _I64, _I, _I, _I, _P, _P, _I]),
    )


def available() -> bool:
    return _fns() is not None


def silu_mul(gu: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gu = [gate | up] rows (float32, CPU, unit-strided); None where the kernel
    does not apply or load."""
    fns = _fns()
    if (
        fns is None
        or gu.dim() != 2
        or gu.device.type != "cpu"
        or gu.dtype != torch.float32
        or gu.stride(1) != 1
    ):
        return None
    inter = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], inter, dtype=torch.float32)
    fns[1](ptr(gu), gu.stride(0), ptr(out), inter, gu.shape[0], inter, torch.get_num_threads())
    return out


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The rotary embedding of x [T, heads, head_dim] in place (rotary.apply_rotary's values, bit for
    bit) with cos and sin [T, 1, head_dim / 2]; False (x untouched) where the kernel does not apply or
    load."""
    fns = _fns()
    t, heads, d = x.shape
    if (
        fns is None
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or cos.dtype != torch.float32
        or x.stride(2) != 1
        or x.stride(1) != d
        or cos.shape != (t, 1, d // 2)
    ):
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    fns[3](ptr(x), x.stride(0), t, heads, d, ptr(cos), ptr(sin), torch.get_num_threads())
    return True


def _weight(w) -> Weight | None:
    operands = getattr(w, "operands", None)
    if operands is None or (hasattr(w, "native") and not w.native):
        return None
    bits, t, d, m = operands()
    return Weight(bits, w.shape[0], w.shape[1], t.data_ptr(), d.data_ptr(), m.data_ptr())


class FusedLayer:
    """One decoder layer's weights as layer.c reads them. The layer keeps the tensors alive."""

    def __init__(self, struct: Layer, scratch_per_row: int, own_per_row: int) -> None:
        self.struct = struct
        self.scratch_per_row = scratch_per_row  # shared by the step's threads, per row
        self.own_per_row = own_per_row  # each thread's own, per row (its normed rows, silu * up)

    @classmethod
    def of(
        cls,
        arch,
        qkv,
        o,
        gate_up,
        down,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        qkv_bias: torch.Tensor | None,
    ) -> FusedLayer | None:
        """None unless every product runs qgemm.c and the norms and bias are float32 (the caller
        leaves out what layer.c does not do: q/k norms). gate_up and down None: the attention half
        only (the residual stream after the attention; a MoE block follows op by op)."""
        if _fns() is None:
            return None
        mlp = [Weight(), Weight()] if gate_up is None else [_weight(gate_up), _weight(down)]
        ws = [_weight(qkv), _weight(o), *mlp]
        floats = [t for t in (input_norm, post_norm, qkv_bias) if t is not None]
        if any(w is None for w in ws) or any(
            t.dtype != torch.float32 or not t.is_contiguous() for t in floats
        ):
            return None
        inter = 0 if gate_up is None else gate_up.shape[0] // 2
        s = Layer(
            *ws,
            input_norm.data_ptr(),
            post_norm.data_ptr(),
            0 if qkv_bias is None else qkv_bias.data_ptr(),
            arch.rms_norm_eps,
            arch.head_dim**-0.5,
            arch.hidden_size,
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            inter,
        )
        per_row = arch.hidden_size + qkv.shape[0] + arch.num_heads * arch.head_dim + 2 * inter
        return cls(s, per_row, max(arch.hidden_size, inter))


class _HasScratch(Protocol):
    scratch_per_row: int
    own_per_row: int


class FusedStack:
    """Every layer's struct in one array, for a step's single call (the layers keep the tensors alive)."""

    def __init__(self, layers: list[FusedLayer]) -> None:
        self.layers = layers
        self.array = (Layer * len(layers))(*[f.struct for f in layers])
        self.scratch_per_row = max(f.scratch_per_row for f in layers)
        self.own_per_row = max(f.own_per_row for f in layers)


def prefill_rows(layers: _HasScratch) -> int:
    """The most rows of a step with prefill chunks for layer.c to run (FUSED_PREFILL_BYTES of its scratch)."""
    return FUSED_PREFILL_BYTES // (
        4 * (layers.scratch_per_row + torch.get_num_threads() * layers.own_per_row)
    )


class FusedStep:
    """A step's shared inputs (positions' rotary rows, cache slots, block tables, the prefill chunks'
    plan) and its scratch, built once and read by every layer's call."""

    def __init__(
        self,
        meta,
        cos: torch.Tensor,
        sin: torch.Tensor,
        n: int,
        layers: _HasScratch,
        plan: tuple[torch.Tensor, torch.Tensor] | None = None,
        window: int = 0,
    ) -> None:
        """`layers`: what the step runs (its scratch per row, shared and each thread's own); `plan`: the
        prefill chunks as prefill_attention.c takes them (attention.prefill_plan), `window` the model's
        sliding window (0: none)."""
        cos, sin = cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()
        slots = meta.slot_mapping.contiguous()
        threads = torch.get_num_threads()
        self.scratch = torch.empty(
            n * (layers.scratch_per_row + threads * layers.own_per_row), dtype=torch.float32
        )
        groups = []
        self._keep = [cos, sin, slots]
        for g in meta.decode_groups:
            first, ctx = (t.contiguous() for t in g.attended())
            table = g.block_idx.contiguous()
            self._keep += [first, ctx, table]
            groups.append(
                Group(
                    g.start,
                    table.shape[0],
                    table.stride(0),
                    table.data_ptr(),
                    first.data_ptr(),
                    ctx.data_ptr(),
                )
            )
        desc, tables = (t.contiguous() for t in plan) if plan is not None else (None, None)
        if desc is not None and tables is not None:
            self._keep += [desc, tables]
        self.struct = Step(
            n,
            meta.block_size,
            len(groups),
            threads,
            0,  # the cache's type: set by run / run_all, which are handed the cache
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            self.scratch.data_ptr(),
            (Group * MAX_GROUPS)(*groups),
            0 if desc is None else desc.data_ptr(),
            0 if tables is None else tables.data_ptr(),
            0 if desc is None else desc.numel() // 4,
            window,
        )
        self._ref = ctypes.byref(self.struct)

    @staticmethod
    def applies(meta, n: int, prefill_rows: int = 0) -> bool:
        """Decodes (one query each, attention.DecodeGroup) within pd_step's groups, and prefill chunks
        where the step has at most `prefill_rows` rows (0: none; the caller's bound where it has the
        prefill kernel for its heads, prefill_rows): every row of the step."""
        groups = meta.decode_groups
        decodes = sum(g.block_idx.shape[0] for g in groups)
        if meta.prefills and n > prefill_rows:
            return False
        return n > 0 and len(groups) <= MAX_GROUPS and decodes + sum(p.q_len for p in meta.prefills) == n

    def run(self, layer: FusedLayer, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """x [n, hidden] float32, contiguous: updated in place to the layer's output."""
        fns = _fns()
        assert fns is not None
        self.struct.kv_bf16 = kv_bf16(k_cache)
        fns[0](ctypes.byref(layer.struct), self._ref, x.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())

    def run_all(self, stack: FusedStack, x: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Every layer, in one native call and one parallel region. kv_cache [layers, 2, slots, KVH, D]
        contiguous past its first two dims (each layer's keys and values are)."""
        fns = _fns()
        assert fns is not None
        self.struct.kv_bf16 = kv_bf16(kv_cache)
        fns[2](
            stack.array,
            len(stack.layers),
            self._ref,
            x.data_ptr(),
            kv_cache.data_ptr(),
            kv_cache.stride(0),
            kv_cache.stride(1),
        )
