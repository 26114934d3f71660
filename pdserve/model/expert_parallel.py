"""Expert parallelism: one worker as N processes, each holding a slice of the physical expert slots.

Rank 0 lives in the engine's process; `ExpertParallelModel` has LlamaModel's `forward`, so the
engine is unchanged. Ranks 1..N-1 are processes spawned on this host running `worker_loop`, or
`pdserve ep-rank` processes on other hosts (ep_remote.py). Every step rank 0 broadcasts the step's
inputs (ep_protocol.py). With data-parallel attention (model.ep_attention: data, `dp_step`) each rank
runs attention, dense layers and shared experts for its own share of the sequences and a MoE layer
sends a token's row only to the ranks holding its chosen experts (dp_attention.py, ep_exchange.py).
With replicated attention every rank runs the whole attention for the whole batch (on CPU the
ranks map rank 0's KV pool in /dev/shm, so their identical writes land in one pool), each MoE layer
computes the routed choices that land in the rank's own slots (plus its share of the shared expert)
and all-reduces the partial sums: it moves [tokens, hidden] per layer, which is fine on one host and
keeps every rank's activations identical.

After each step the ranks sum their counts of the expert choices of the tokens each owns (one small
all-reduce): that is the global load that rank 0's expert balancer (eplb/balancer.py) reads. Rank 0
drives the weight mover on every rank: a new placement is announced with FLAG_PREPARE (each rank
builds it in the background) and switched to with FLAG_COMMIT at the start of a later step, on all
ranks at the same step boundary.

Exposure: the ranks of one host meet through a file store in a private directory and gloo connects
them over loopback only; nothing listens beyond this host (a TCP store and gloo's default device
would listen on every interface, unauthenticated, for the engine's lifetime). Ranks on other hosts
(model.ep_rendezvous) meet at a TCP store whose keys the internal token names (ep_hosts.py), keep KV
pools of their own (ep_kv.py) and only their own expert slots (ep_fetch.py).

Failure: any collective has a deadline (model.ep_timeout_s), and an idle rank 0's heartbeat is
answered by every rank. A worker that hears nothing from rank 0 (no step, no heartbeat) for
WORKER_IDLE_TIMEOUT_S, whose connection to rank 0 breaks, or whose parent process disappears, exits.
Rank 0 raises on a dead or silent worker, which fails the engine instead of hanging it.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.config import ModelConfig
from pdserve.eplb.balancer import ExpertBalancer
from pdserve.eplb.mover import ExpertWeightMover
from pdserve.eplb.recorder import StepCounts
from pdserve.model import ep_shm
from pdserve.model.arch import ModelArch
from pdserve.model.attention import AttentionMetadata
from pdserve.model.dp_attention import StepShare, split_step, step_units, token_cost
from pdserve.model.ep_exchange import ExpertExchange
from pdserve.model.ep_fetch import Fetched, fetch_experts
from pdserve.model.ep_hosts import (
    START_TIMEOUT_S,
    local_ranks,
    own_address,
    publish_spec,
    rendezvous_problem,
    rendezvous_store,
    split_address,
)
from pdserve.model.ep_kv import Residency, StepPlan, decode_plan, encode_plan, mirror, ship
from pdserve.model.ep_overlap import Baton
from pdserve.model.ep_protocol import (
    FLAG_COMMIT,
    FLAG_DP,
    FLAG_KV,
    FLAG_PREPARE,
    FLAG_PRIVATE,
    HEADER_LEN,
    OP_NOOP,
    OP_STEP,
    OP_STOP,
    Comm,
    Header,
    decode_step,
    encode_step,
)
from pdserve.model.kernels import qgemm
from pdserve.model.moe_model import MoEModel, initial_placement, pack_experts
from pdserve.model.quant import MODES
from pdserve.model.stored_quant import resolve_quantization
from pdserve.utils.cpu import feature_key
from pdserve.utils.runtime import trim_heap
from pdserve.utils.shm import attach_shared_kv

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0  # an idle rank 0 sends a NOOP this often, which every rank answers
WORKER_IDLE_TIMEOUT_S = 30.0  # a worker hearing nothing from rank 0 this long exits


def _rank_device(device: str, rank: int, world: int) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.device_count() >= world:
        return torch.device("cuda", rank)
    return d


def _process_group(store, rank: int, world: int, device: torch.device, timeout_s: float, host: str):
    """NCCL when every rank has its own GPU, else gloo (device tensors then travel through host memory),
    listening on `host` only: loopback when the ranks share one host."""
    if device.type == "cuda" and dist.is_nccl_available() and torch.cuda.device_count() >= world:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    opts = dist.ProcessGroupGloo._Options()
    # The group's own deadline is the rendezvous' (ranks of other hosts load their model first); every
    # collective passes the step's deadline itself (ep_protocol.Comm).
    opts._timeout = timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world, opts)


def _file_store(path: str, world: int, timeout_s: float):
    store = dist.FileStore(path, world)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _store(spec: "RankSpec", rank0: bool):
    if spec.rendezvous:
        return rendezvous_store(spec.rendezvous, spec.token, rank0)
    return _file_store(spec.store_path, spec.world, spec.timeout_s)


@dataclass
class RankSpec:
    arch: ModelArch
    dtype: torch.dtype
    device: str
    max_model_len: int
    phy2log: torch.Tensor
    rank: int
    world: int
    store_path: str
    threads: int
    parent_pid: int
    quantization: str = "none"
    attention_kernel: str = "auto"
    gemm_kernel: str = "auto"
    activation_quantization: str = "none"
    exchange_path: str = ""  # ep_shm's mailboxes (rank 0 made them); empty: gloo's all-to-all
    timeout_s: float = 60.0  # deadline of each collective (model.ep_timeout_s)
    rendezvous: str = ""  # model.ep_rendezvous: the TCP store of ranks on several hosts; empty: a file store
    token: str | None = None  # the internal token (names the rendezvous' keys)
    host: str = "127.0.0.1"  # the address this rank's gloo device listens on
    local: int = 1  # ranks 0..local-1 share rank 0's host (and its copy of every expert)
    overlap: bool = False  # two micro-batches a step (model.ep_overlap; every rank alike)
    dispatch_dtype: str = "model"  # model.ep_dispatch_dtype (every rank alike)
    # Rank 0's kernel paths (qgemm.paths): each rank's products take them, so a row's bits do not
    # depend on which rank computes it (each process's own tuning could choose otherwise).
    kernel_paths: dict[str, int] = field(default_factory=dict)
    kernel_features: str = ""  # the CPU features rank 0's paths were chosen for (utils/cpu.feature_key)


# The values of a spec that ranks of other hosts read from the rendezvous (ep_hosts.publish_spec).
SHARED_SPEC = (
    "dtype",
    "max_model_len",
    "world",
    "threads",
    "quantization",
    "attention_kernel",
    "gemm_kernel",
    "activation_quantization",
    "timeout_s",
    "local",
    "overlap",
    "dispatch_dtype",
    "kernel_paths",
    "kernel_features",
)


def _after_collectives(layer_done, moe_ids: list[int], num_layers: int):
    """(hook, finish): `layer_done` for layer i only once every rank has written layer i's KV. With
    data-parallel attention another rank writes its own sequences' KV into the shared pool; a MoE
    layer's exchange waits for every rank, which has passed that layer's attention by then, so a MoE
    layer releases itself and the dense layers before it, and `finish` (after the last exchange of
    the step) the rest."""
    moe, fired = set(moe_ids), [-1]

    def upto(i: int) -> None:
        for j in range(fired[0] + 1, i + 1):
            layer_done(j)
        fired[0] = max(fired[0], i)

    def hook(i: int) -> None:
        if i in moe:
            upto(i)

    return hook, lambda: upto(num_layers - 1)


def dp_step(
    model: MoEModel,
    exchange: ExpertExchange,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: torch.Tensor,
    logits_indices: torch.Tensor | None,
    layer_done=None,
    plan: StepPlan | None = None,
) -> torch.Tensor | None:
    """One step with data-parallel attention, on every rank alike: this rank's share of the sequences
    through the model (the MoE layers exchanging rows), then every rank's final-normed rows of the
    logits the step wants to rank 0, which runs the output head over all of them at once and returns
    the logits in the step's order (the other ranks return None). A row is `hidden` values where its
    logits are `vocab`: across hosts the logits rows were most of a step's bytes, and the head's
    weights are read on one rank only. With `plan` the ranks keep private
    KV pools (ep_kv.py): the split is the plan's, the blocks it names are sent first, and the KV the
    other ranks wrote reaches rank 0's pool before the step returns."""
    rank, world = exchange.rank, exchange.world
    shares = split_step(
        meta,
        input_ids.shape[0],
        logits_indices,
        world,
        token_cost(model.arch),
        None if plan is None else plan.ranks,
    )
    mine = shares[rank]
    hook = finish = None
    if layer_done is not None and plan is None:
        hook, finish = _after_collectives(layer_done, model.moe_ids, model.arch.num_layers)
    elif layer_done is not None:  # every layer's KV is in rank 0's pool once the mirror is done

        def finish() -> None:
            for i in range(model.arch.num_layers):
                layer_done(i)

    model.set_exchange(exchange)
    try:
        if plan is not None:
            exchange.kv_shipped_bytes += ship(exchange.comm, kv_cache, meta.block_size, plan.ship)
        wanted = logits_indices is not None
        if exchange.baton is None:
            rows = _run_share(model, mine, input_ids, positions, kv_cache, wanted, hook)
        else:
            rows = _run_halves(model, exchange.baton, mine, input_ids, positions, kv_cache, wanted, hook)
        if plan is not None:
            exchange.kv_mirrored_bytes += mirror(exchange.comm, kv_cache, shares)
        if logits_indices is None:
            return None
        H = model.arch.hidden_size
        mine_rows = rows.cpu() if rows is not None else torch.zeros(0, H, dtype=model.dtype)
        sizes = [s.logits_rows.numel() for s in shares]
        got = exchange.comm.all_to_all(
            mine_rows, sizes if rank == 0 else [0] * world, [mine_rows.shape[0]] + [0] * (world - 1)
        )
        row = H * got.element_size()
        exchange.logits_bytes += row * (sum(sizes[1:]) if rank == 0 else mine_rows.shape[0])
    finally:
        model.set_exchange(None)
        if finish is not None:
            finish()
    if rank != 0:
        return None
    out = torch.empty(logits_indices.numel(), H, dtype=got.dtype)
    out[torch.cat([s.logits_order for s in shares])] = got
    return model.head(out.to(model.device))


def dispatch_dtype(name: str) -> torch.dtype | None:
    """model.ep_dispatch_dtype's dtype (None: the model's own)."""
    if name not in ("model", "bfloat16"):
        raise ValueError(f"model.ep_dispatch_dtype: {name!r} is not model or bfloat16")
    return None if name == "model" else torch.bfloat16


def _run_share(
    model: MoEModel,
    share: StepShare,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    wanted: bool,
    hook,
) -> torch.Tensor | None:
    """`share` through the model: the final-normed rows of its logits rows, in its order (None when
    the step wants none or the share has no logits row)."""
    if not share.tokens.numel():
        model.idle_step()
        return None
    tok = share.tokens.to(input_ids.device)
    rows = share.logits_rows.to(input_ids.device) if wanted else None
    return model.forward(
        input_ids.index_select(0, tok),
        positions.index_select(0, tok),
        share.meta,
        kv_cache,
        rows,
        hook,
        head=False,
    )


def _run_halves(
    model: MoEModel,
    baton: Baton,
    mine: StepShare,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    wanted: bool,
    hook,
) -> torch.Tensor | None:
    """`mine` as two micro-batches overlapping their exchanges (ep_overlap.py); the same result as
    `_run_share`. Each half's tokens, renumbered within it, map back through `mine.tokens`."""
    halves = split_step(
        mine.meta,
        mine.tokens.numel(),
        mine.logits_rows if wanted else None,
        2,
        token_cost(model.arch),
    )
    for h in halves:
        h.tokens = mine.tokens[h.tokens]
    both = hook
    if hook is not None:  # a layer is done once both micro-batches (those with tokens) passed it
        need, seen = sum(1 for h in halves if h.tokens.numel()), [0] * model.arch.num_layers

        def both(i: int) -> None:
            seen[i] += 1
            if seen[i] == need:
                hook(i)

    out = baton.run(
        *[
            functools.partial(_run_share, model, h, input_ids, positions, kv_cache, wanted, both)
            for h in halves
        ]
    )
    if not wanted or not mine.logits_rows.numel():
        return None
    got = [(h, x) for h, x in zip(halves, out) if x is not None]
    rows = torch.empty(
        mine.logits_rows.numel(), got[0][1].shape[1], dtype=got[0][1].dtype, device=got[0][1].device
    )
    for h, x in got:
        rows[h.logits_order.to(x.device)] = x
    return rows


class ExpertParallelModel:
    """Rank 0 of a MoE model over `model_config.expert_parallel` ranks (one rank: no processes)."""

    def __init__(
        self,
        loaded,
        dtype: torch.dtype,
        device: str,
        max_model_len: int | None,
        mc: ModelConfig,
        token: str | None = None,
    ) -> None:
        """`token`: the internal token, which names the rendezvous of ranks on other hosts."""
        arch, world = loaded.arch, int(mc.expert_parallel)
        local = local_ranks(world, mc.ep_local_ranks)
        num_physical = arch.num_experts + int(mc.num_redundant_experts)
        if world < 1 or mc.num_redundant_experts < 0:
            raise ValueError("model.expert_parallel must be >= 1 and model.num_redundant_experts >= 0")
        if num_physical < world:
            raise ValueError(f"{num_physical} expert slots cannot be spread over {world} ranks")
        quant = resolve_quantization(mc.quantization, loaded.name)
        if quant not in MODES:
            raise ValueError(f"model.quantization: {quant!r} is not one of {', '.join(MODES)}")
        self.arch, self.dtype, self.world = arch, dtype, world
        if mc.ep_attention not in ("data", "replicated"):
            raise ValueError(f"model.ep_attention: {mc.ep_attention!r} is not data or replicated")
        dispatch_dtype(mc.ep_dispatch_dtype)  # a bad name fails here, before any rank starts
        if mc.ep_overlap and mc.ep_attention != "data":
            raise ValueError("model.ep_overlap needs model.ep_attention: data")
        self.data_parallel = mc.ep_attention == "data"
        # Ranks on other hosts keep their own KV pools (ep_kv.py) and only their own expert slots
        # (ep_fetch.py); so, then, do this host's.
        self.private = local < world
        self._local = local  # ranks per host: 0..local-1 on this one
        self.experts_sent_bytes = 0  # experts this rank sent to the others for new placements
        if self.private and not (self.data_parallel and mc.ep_rendezvous):
            raise ValueError("ranks on other hosts need model.ep_rendezvous and model.ep_attention: data")
        if problem := rendezvous_problem(mc.ep_rendezvous, token):
            raise ValueError(problem)
        if self.private and torch.device(device).type != "cpu":
            raise ValueError("expert parallelism across hosts runs on CPU only")
        phy2log = initial_placement(arch, num_physical, world)
        weights = loaded.weights
        self._ranks = _Ranks()
        if world > 1:
            # One copy of the weights in shared memory serves every rank, and is the mover's source; the
            # experts packed (quantized) once, here, rather than by every rank.
            native = mc.gemm_kernel == "auto" and torch.device(device).type == "cpu"
            experts = pack_experts(weights, arch, quant, dtype, native)
            weights = {
                k: experts[k].share_memory_()
                if k in experts
                else v.to(dtype if v.is_floating_point() else v.dtype).share_memory_()
                for k, v in weights.items()
            }
            host = own_address(split_address(mc.ep_rendezvous)[0]) if mc.ep_rendezvous else "127.0.0.1"
            self._ranks.start(
                world,
                local,
                RankSpec(
                    arch,
                    dtype,
                    device,
                    max_model_len or arch.max_position_embeddings,
                    phy2log,
                    0,
                    world,
                    "",
                    torch.get_num_threads(),
                    os.getpid(),
                    quant,
                    mc.attention_kernel,
                    mc.gemm_kernel,
                    mc.activation_quantization,
                    timeout_s=float(mc.ep_timeout_s),
                    rendezvous=mc.ep_rendezvous or "",
                    token=token,
                    host=host,
                    local=local,
                    overlap=mc.ep_overlap,
                    dispatch_dtype=mc.ep_dispatch_dtype,
                    kernel_paths=qgemm.paths() if native else {},
                    kernel_features=feature_key(),
                ),
                weights,
                _rank_device(device, 0, world),
            )
        comm = self._ranks.comm
        self.exchange = (
            ExpertExchange(comm, 0, world, mc.ep_overlap, dispatch_dtype(mc.ep_dispatch_dtype))
            if comm is not None
            else None
        )
        self.model = MoEModel(
            arch,
            weights,
            dtype,
            _rank_device(device, 0, world),
            max_model_len,
            phy2log=phy2log,
            rank=0,
            world=world,
            combine=comm.all_reduce if comm else None,
            quantization=quant,
            attention_kernel=mc.attention_kernel,
            gemm_kernel=mc.gemm_kernel,
            activation_quantization=mc.activation_quantization,
        )
        if self.private:
            # Every rank has built its slots from the shared copy: each keeps its own, and the copy
            # of every expert goes (the spawned ranks' arguments share this dict: emptied, it holds
            # nothing there either). New placements fetch experts from the ranks holding them.
            self.model.keep_own_experts()
            weights.clear()
            del experts
            trim_heap()
        self.device, self.max_model_len = self.model.device, self.model.max_model_len
        self.mover = ExpertWeightMover(self.model)
        self.eplb = ExpertBalancer(
            self.model.moe_ids,
            arch.num_experts,
            phy2log,
            world,
            mc.eplb_window,
            mc.eplb_interval,
            mc.eplb_threshold,
            # Hosts of ep_local_ranks ranks each: replicas placed within a host, expert groups kept
            # on few hosts.
            num_nodes=world // local if world % local == 0 else 1,
            num_groups=arch.n_group if arch.n_group > 1 and world // local > 1 else None,
        )
        # Each rank counts its own tokens' choices; the sum over the ranks is the step's load.
        self._counts = StepCounts(self.model.moe_ids, arch.num_experts, 0, world)
        self.model.set_load_hook(self._counts.record)
        self._step = 0
        self._pending: torch.Tensor | None = None  # planned, not yet announced
        self._preparing: torch.Tensor | None = None  # announced, being built on every rank
        self._kv_shared: tuple[int, str] | None = None  # (data_ptr, /dev/shm path) of rank 0's pool
        self._kv_ptr: int | None = None  # the KV cache the other ranks know
        self._residency: Residency | None = None  # with private pools: which rank holds which block
        self._finalizer = weakref.finalize(self, self._ranks.close)

    @property
    def num_physical(self) -> int:
        return self.model.num_physical

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def request_placement(self, phy2log: torch.Tensor) -> None:
        """Move to `phy2log` ([moe layers, P]) over the next steps, as a rebalance would."""
        phy2log = torch.as_tensor(phy2log, dtype=torch.long)
        if tuple(phy2log.shape) != tuple(self.model.phy2log.shape):
            raise ValueError(f"placement must be {tuple(self.model.phy2log.shape)}")
        self._pending = self.eplb.plan(phy2log)

    def share_kv_cache(self, kv_cache: torch.Tensor, path: str | None) -> None:
        """The engine's KV pool lives in the file `path` (/dev/shm): the other ranks map it too."""
        self._kv_shared = (kv_cache.data_ptr(), path) if path else None

    def traffic(self) -> dict[str, int]:
        """Bytes between rank 0 and the other ranks since start, by kind (rank 0's side: what it sent
        of dispatch, combine, KV blocks and experts; what it received of KV rows and logits), and
        the steps run: the EP plane's load on the network (/metrics pdserve_ep_bytes_total)."""
        ex = self.exchange
        if ex is None:
            return {}
        return {
            "dispatch": ex.dispatch_bytes,
            "combine": ex.combine_bytes,
            "kv_shipped": ex.kv_shipped_bytes,
            "kv_mirrored": ex.kv_mirrored_bytes,
            "logits": ex.logits_bytes,
            "experts": self.experts_sent_bytes,
            "steps": self._step,
        }

    def kv_blocks_allocated(self, blocks: list[int]) -> None:
        """The engine's pool handed `blocks` out anew (block_pool.BlockPool.on_allocate): the other
        ranks' copies of them are stale."""
        res = self._residency
        if res is not None and blocks:
            res.allocated(blocks)

    def close(self) -> None:
        self._finalizer()

    def failure(self) -> BaseException | None:
        """Why the rank group cannot run a step, or None: read while the engine is idle, so a rank that
        dies between requests fails the worker's health at once rather than the next request."""
        return self._ranks.failure()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_indices: torch.Tensor | None,
        layer_done=None,
    ) -> torch.Tensor | None:
        r = self._ranks
        with r.lock:
            if r.error is not None:
                raise RuntimeError("an expert-parallel rank failed") from r.error
            flags = 0
            if self._preparing is not None and self.mover.ready():
                flags |= FLAG_COMMIT
            announce = self._pending is not None and (self._preparing is None or flags & FLAG_COMMIT)
            if announce:
                flags |= FLAG_PREPARE
            # Data-parallel attention needs every rank to see every sequence's KV: one shared pool, or
            # private pools kept in step by ep_kv.py.
            shared = (
                not self.private and self._kv_shared is not None and self._kv_shared[0] == kv_cache.data_ptr()
            )
            dp = self.data_parallel and self.exchange is not None and (shared or self.private)
            plan = None
            if dp:
                flags |= FLAG_DP
            if dp and self.private:
                flags |= FLAG_PRIVATE
                blocks = kv_cache.shape[2] // meta.block_size
                if kv_cache.data_ptr() != self._kv_ptr or self._residency is None:
                    self._residency = Residency(self.world, blocks)  # a new pool: nothing held yet
                plan = self._residency.plan(meta, step_units(meta), token_cost(self.arch))
            if r.comm is not None:
                h, ints, mask = encode_step(input_ids, positions, meta, logits_indices)
                extras = []
                if kv_cache.data_ptr() != self._kv_ptr:
                    path = torch.tensor(
                        list(self._kv_shared[1].encode()) if shared else [], dtype=torch.uint8
                    )
                    flags |= FLAG_KV
                    h.kv_path = path.numel()
                    extras.append(path)
                if announce:
                    extras.append(self._pending)
                extras += [ints, mask] if h.masks else [ints]
                if plan is not None:
                    extras.append(encode_plan(plan))
                    h.plan = extras[-1].numel()
                h.flags, h.step, h.kv_slots = flags, self._step, kv_cache.shape[2]
                r.send(h, [e for e in extras if e.numel()])
                self._kv_ptr = kv_cache.data_ptr()
            if flags & FLAG_COMMIT:
                self.mover.commit()
                self.eplb.committed(self._preparing)
                self._preparing = None
            if announce:
                got = None
                if self.private:  # after every broadcast of the step, as the ranks do
                    got = _fetch(self.model, r.comm, self._pending, self._local)
                    self.experts_sent_bytes += got.sent_bytes
                self.mover.prepare(self._pending, got.experts if got is not None else None)
                del got  # the mover alone holds the fetched experts: it lets go of them at the commit
                self._preparing, self._pending = self._pending, None
            self.model.set_step(self._step)
            try:
                self._counts.all_own = dp
                if dp:
                    logits = dp_step(
                        self.model,
                        self.exchange,
                        input_ids,
                        positions,
                        meta,
                        kv_cache,
                        logits_indices,
                        layer_done,
                        plan,
                    )
                else:
                    logits = self.model.forward(
                        input_ids, positions, meta, kv_cache, logits_indices, layer_done
                    )
                counts = self._counts.take()
                if r.comm is not None:
                    counts = r.comm.all_reduce(counts)
            except BaseException as exc:
                if r.comm is not None:
                    # A step cut short (a dead rank, or an error here) leaves the ranks out of step.
                    r.error = exc
                raise
            if plan is not None:
                self._residency.update(plan)
            self.eplb.record_counts(counts)
            self._step += 1
        planned = self.eplb.end_step()
        if planned is not None and self._pending is None and self._preparing is None:
            self._pending = planned
        return logits


class _Ranks:
    """Rank 0's side of the worker processes: spawn, send, heartbeat, stop."""

    def __init__(self) -> None:
        self.comm: Comm | None = None
        self.lock = threading.Lock()
        self.procs: list = []
        self.error: BaseException | None = None
        self._closed = threading.Event()
        self._last_send = time.monotonic()
        self._store = None
        self._store_dir: str | None = None
        self._shm_path: str | None = None

    def start(self, world: int, local: int, spec: RankSpec, weights: dict, device: torch.device) -> None:
        """Spawn ranks 1..local-1 here and form the group with them and with the ranks of other hosts
        (local..world-1, which join at the rendezvous)."""
        path = ""
        if spec.rendezvous:
            self._store = rendezvous_store(spec.rendezvous, spec.token, True)
            shared = {k: getattr(spec, k) for k in SHARED_SPEC}
            shared["dtype"] = str(spec.dtype).removeprefix("torch.")
            publish_spec(self._store, shared, spec.arch, spec.phy2log)
        else:
            self._store_dir = tempfile.mkdtemp(prefix="pdserve-ep-")  # mode 0700: this user's processes only
            path = os.path.join(self._store_dir, "store")
            self._store = _file_store(path, world, spec.timeout_s)
        shm = None
        if device.type == "cpu" and local == world and ep_shm.available():
            shm = ep_shm.create(world)
            self._shm_path = shm
        ctx = mp.get_context("spawn")
        for rank in range(1, local):
            s = RankSpec(**{**spec.__dict__, "rank": rank, "store_path": path, "exchange_path": shm or ""})
            p = ctx.Process(target=worker_loop, args=(s, weights), name=f"pdserve-ep{rank}", daemon=True)
            p.start()
            self.procs.append(p)
        try:
            self.comm = Comm(self._connect(world, device, spec), 0, world, device, spec.timeout_s)
            if shm is not None:
                # Every rank mapped the mailboxes before joining the group: the name can go now.
                self.comm.shm = ep_shm.ShmAllToAll(shm, 0, world)
                self._unlink_shm()
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._heartbeat, name="pdserve-ep-heartbeat", daemon=True).start()

    def _connect(self, world: int, device: torch.device, spec: RankSpec):
        """Rank 0's process group, failing fast if a worker dies while the group forms."""
        box: dict = {}

        def connect() -> None:
            try:
                box["pg"] = _process_group(self._store, 0, world, device, spec.timeout_s, spec.host)
            except BaseException as exc:
                box["error"] = exc

        t = threading.Thread(target=connect, name="pdserve-ep-connect", daemon=True)
        t.start()
        if spec.rendezvous and len(self.procs) + 1 < world:
            log.info("expert parallelism: waiting at %s for the ranks of other hosts", spec.rendezvous)
        while t.is_alive():
            t.join(0.2)
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead and t.is_alive():
                raise RuntimeError(
                    f"expert-parallel worker {dead[0].name} exited with code {dead[0].exitcode} "
                    "while starting"
                )
        if "error" in box:
            raise box["error"]
        return box["pg"]

    def send(self, h: Header, extras: list[torch.Tensor] = ()) -> None:
        """The header, then the tensors it announces in protocol order (lock held); a failure marks
        the group dead."""
        try:
            for t in (h.to_tensor(), *extras):
                self.comm.broadcast(t)
            self._last_send = time.monotonic()
        except BaseException as exc:
            self.error = exc
            raise

    def failure(self) -> BaseException | None:
        if self.error is None and not self._closed.is_set():
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                self.error = RuntimeError(
                    f"expert-parallel rank {dead[0].name} exited with code {dead[0].exitcode}"
                )
        return self.error

    def _heartbeat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S / 2):
            with self.lock:
                if self._closed.is_set() or self.error is not None:
                    return
                if time.monotonic() - self._last_send < HEARTBEAT_S:
                    continue
                try:
                    self.send(Header(OP_NOOP))
                    self.comm.all_reduce(torch.zeros(1))  # every rank answers: none is lost
                except BaseException as exc:
                    self.error = self.error or exc
                    log.error("expert-parallel heartbeat failed, a rank is gone: %s", exc)
                    return

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        # A step stuck on a dead rank holds the lock until its deadline: do not wait for it, kill instead.
        if self.comm is not None and self.error is None and self.lock.acquire(timeout=10):
            try:
                self.comm.broadcast(Header(OP_STOP).to_tensor(), timeout=timedelta(seconds=5))
            except BaseException:
                pass
            finally:
                self.lock.release()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
        self._unlink_shm()

    def _unlink_shm(self) -> None:
        if self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            self._shm_path = None


# ---------------------------------------------------------------- ranks 1..N-1


def _exit_with_parent(parent_pid: int) -> None:
    # Covers a rank 0 killed outright: the broken connection usually wakes the worker first.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_loop(spec: RankSpec, weights: dict) -> bool:
    """A rank > 0 on rank 0's host: build this rank's part of the model, join the group, then follow
    rank 0's steps until OP_STOP (True) or until rank 0 is gone (False)."""
    model, comms = rank_model(spec, weights)
    if spec.local < spec.world:  # ranks span hosts: each keeps only its own slots, as rank 0 does
        model.keep_own_experts()
    # The process's arguments hold this dict: emptied, the shared copy is no longer mapped here.
    weights.clear()
    trim_heap()
    return join_and_follow(spec, model, comms)


def rank_model(spec: RankSpec, weights) -> tuple[MoEModel, list[Comm]]:
    """This rank's part of the model (built before the group forms: its deadlines start then), and
    the list its combine reads the group's Comm from once joined."""
    # A signal to the process group (Ctrl-C, SIGTERM's drain) is for rank 0: it finishes its requests,
    # which need these ranks, and then stops them with OP_STOP.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)  # as rank 0, so replicated attention computes identical bits
    if spec.kernel_paths:
        qgemm.set_paths(spec.kernel_paths)
    if spec.parent_pid:
        threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    device = _rank_device(spec.device, spec.rank, spec.world)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds a rank's communicator to its current device
    comms: list[Comm] = []
    model = MoEModel(
        spec.arch,
        weights,
        spec.dtype,
        device,
        spec.max_model_len,
        phy2log=spec.phy2log,
        rank=spec.rank,
        world=spec.world,
        combine=lambda t: comms[0].all_reduce(t),
        quantization=spec.quantization,
        attention_kernel=spec.attention_kernel,
        gemm_kernel=spec.gemm_kernel,
        activation_quantization=spec.activation_quantization,
    )
    return model, comms


def join_and_follow(spec: RankSpec, model: MoEModel, comms: list[Comm], store=None) -> bool:
    """Join the group (through `store`, or the spec's), then follow rank 0's steps."""
    device = model.device
    # Mapped before joining the group: rank 0 unlinks the name once every rank has joined.
    shm = ep_shm.ShmAllToAll(spec.exchange_path, spec.rank, spec.world) if spec.exchange_path else None
    pg = _process_group(
        store if store is not None else _store(spec, False),
        spec.rank,
        spec.world,
        device,
        spec.timeout_s,
        spec.host,
    )
    comm = Comm(pg, spec.rank, spec.world, device, spec.timeout_s)
    comm.shm = shm
    comms.append(comm)
    return _follow(spec, model, comm, device)


def _follow(spec: RankSpec, model: MoEModel, comm: Comm, device: torch.device) -> bool:
    mover = ExpertWeightMover(model)
    exchange = ExpertExchange(comm, spec.rank, spec.world, spec.overlap, dispatch_dtype(spec.dispatch_dtype))
    counts = StepCounts(model.moe_ids, spec.arch.num_experts, spec.rank, spec.world)
    model.set_load_hook(counts.record)
    kv = None
    idle = timedelta(seconds=WORKER_IDLE_TIMEOUT_S)
    with torch.inference_mode():
        while True:
            try:
                h = Header.from_tensor(
                    comm.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long), timeout=idle)
                )
            except RuntimeError as exc:
                log.warning("expert-parallel rank %d: rank 0 is gone (%s); exiting", spec.rank, exc)
                return False
            if h.op == OP_STOP:
                return True
            if h.op == OP_NOOP:
                comm.all_reduce(torch.zeros(1))  # the heartbeat's answer
                continue
            if h.flags & FLAG_KV:
                path = (
                    bytes(comm.broadcast(torch.zeros(h.kv_path, dtype=torch.uint8)).tolist()).decode()
                    if h.kv_path
                    else ""
                )
                kv = _worker_kv(spec, h.kv_slots, path, device)
            if h.flags & FLAG_COMMIT:
                mover.commit()
            placement = None
            if h.flags & FLAG_PREPARE:
                placement = comm.broadcast(torch.zeros_like(model.phy2log))
            if h.op != OP_STEP:
                continue
            ints = comm.broadcast(torch.zeros(h.ints, dtype=torch.long))
            mask = comm.broadcast(torch.zeros(h.masks, dtype=torch.uint8)) if h.masks else torch.zeros(0)
            ids, positions, meta, logits = decode_step(h, ints, mask, device)
            plan = None
            if h.flags & FLAG_PRIVATE:
                plan = decode_plan(
                    comm.broadcast(torch.zeros(h.plan, dtype=torch.long)), len(step_units(meta)), spec.world
                )
            if placement is not None:
                # No rank holds every expert where the ranks span hosts: each fetches what it lacks
                # (handed to the mover alone, which lets go of it at the commit).
                private = spec.local < spec.world
                mover.prepare(
                    placement, _fetch(model, comm, placement, spec.local).experts if private else None
                )
            model.set_step(h.step)
            counts.all_own = bool(h.flags & FLAG_DP)
            if counts.all_own:
                dp_step(model, exchange, ids, positions, meta, kv, logits, plan=plan)
            else:
                model.forward(ids, positions, meta, kv, None)
            comm.all_reduce(counts.take())  # this rank's share of the step's expert load, to rank 0


def _fetch(model: MoEModel, comm: Comm, placement: torch.Tensor, per_host: int) -> Fetched:
    """ep_fetch.fetch_experts from the placement in force to `placement`: this rank's slots are what
    it sends from."""
    own = [(b.placement.gate_up, b.placement.down) for b in model.blocks]
    return fetch_experts(comm, model.phy2log, placement, per_host, own)


def _worker_kv(spec: RankSpec, slots: int, path: str, device: torch.device) -> torch.Tensor:
    """Rank 0's pool mapped from `path`, or a private cache of the same shape (on the host: zero pages
    that become resident as blocks are written, so a rank holds what its sequences use)."""
    a = spec.arch
    shape = a.kv_cache_shape(slots)
    es = torch.empty((), dtype=spec.dtype).element_size()
    if not path:
        if device.type != "cpu":
            return torch.zeros(shape, dtype=spec.dtype, device=device)
        size = es * math.prod(shape)
        pages = np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=np.uint8, count=size)  # keeps the map
        return torch.from_numpy(pages).view(spec.dtype).view(shape)
    return torch.from_numpy(attach_shared_kv(path, shape, es)).view(spec.dtype).view(shape)
