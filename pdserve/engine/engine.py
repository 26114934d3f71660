"""The engine: scheduler + model runner + KV pool, stepped by its owner (offline API or server loop)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.kv_cache import allocate_kv_cache, new_shm_path, num_blocks_for_budget
from pdserve.cache.prefix_cache import PrefixCache
from pdserve.cache.swap import SwapSpace
from pdserve.cache.tiers.manager import TieredKVStore
from pdserve.common.detokenizer import IncrementalDetokenizer, NoText
from pdserve.common.errors import DuplicateRequestId, InvalidParam
from pdserve.common.images import ImageInput
from pdserve.common.internal_token import internal_token
from pdserve.common.outputs import RequestOutput, TokenLogprob  # noqa: F401 (RequestOutput re-exported)
from pdserve.common.paths import measuring_alone
from pdserve.common.sampling import SamplingParams, check_prompt
from pdserve.config import Config
from pdserve.config_rules import ConfigError
from pdserve.engine import prefetch_tuning
from pdserve.engine.draft_model import DraftModel
from pdserve.engine.grammar import Grammars
from pdserve.engine.image_inputs import image_embeddings
from pdserve.engine.kv_connector import (
    AbortJob,
    AddJob,
    ConnectorEvent,
    KVConnector,
    LoadDone,
    LoadFailed,
    LoadRetry,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.row_costs import (
    RowCosts,
    cache_key,
    cache_path,
    calibrate,
    context_blocks,
    load_cached,
    save_cached,
)
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Scheduler, blocks_needed
from pdserve.engine.spec_decode import eligible, propose
from pdserve.engine.spec_policy import acceptance, choose
from pdserve.engine.tier_fetch import TierFetcher
from pdserve.engine.tier_identity import digested_as_read, tier_key, tier_namespace, weights_digest
from pdserve.model.arch import ModelArch
from pdserve.model.kernels import qgemm
from pdserve.model.kv_dtype import resolve_kv_dtype
from pdserve.model.loader import LoadedModel, build_model, load_model_files, torch_dtype
from pdserve.model.stored_quant import with_resolved_quantization
from pdserve.utils.core_share import CoreShare
from pdserve.utils.runtime import memory_status, trim_heap, tune_malloc

if TYPE_CHECKING:
    from pdserve.cache.kv_events import KVEventPublisher

log = logging.getLogger(__name__)
# The most rows of a step whose int4 and int8 products model.batch_invariant (and speculative decoding)
# keep on one arithmetic: more are a prefill's, where the row-count paths are several times faster.
INVARIANT_ROWS = 256
# How long a worker waits for another's row-cost calibration (a few seconds of steps) before its own.
ROW_COSTS_WAIT_S = 60.0


def kv_cache_dtype(config: Config, arch: ModelArch) -> torch.dtype:
    """cache.kv_dtype resolved (model/kv_dtype.py); a dtype other than the model's where the attention
    paths keep it (not MLA's latent cache, not expert-parallel ranks' pools)."""
    mc, want = config.model, config.cache.kv_dtype
    dtype = torch_dtype(resolve_kv_dtype(config, arch))
    if dtype != torch_dtype(mc.dtype) and (arch.is_mla or mc.expert_parallel > 1):
        why = "an MLA model's latent cache" if arch.is_mla else "expert parallelism's pools"
        raise ConfigError([("cache.kv_dtype", f"{want} is not supported for {why}; use auto")])
    return dtype


class LLMEngine:
    def __init__(
        self,
        config: Config,
        loaded: LoadedModel | None = None,
        shm_path: str | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        """`kv_events` publishes the blocks this engine holds, per tier (the router's KV index)."""
        # `auto` becomes what the weights are stored as, before anything reads it (the load, the KV tiers'
        # namespace, the log line, engine.config): a worker given `auto` and one given the value it
        # resolves to serve and name their KV alike.
        asked = config.model.quantization
        config = with_resolved_quantization(config, loaded.name if loaded is not None else None)
        self.config = config
        mc, cc = config.model, config.cache
        tune_malloc()
        if config.server.threads:
            torch.set_num_threads(config.server.threads)
        # Set by a worker of a one-machine deployment whose workers lend each other idle cores.
        self.core_share: CoreShare | None = None
        self.borrowing_steps = 0
        self.prefill_borrowing_steps = 0
        sc = config.scheduler
        self.spec_tokens = sc.num_speculative_tokens if sc.speculative_method != "none" else 0
        native = mc.quantization in ("int4", "int8") and mc.activation_quantization == "none"
        if native and mc.device == "cpu" and (self.spec_tokens or mc.batch_invariant):
            # A verify step's rows must compute what a plain step's would (greedy stays identical):
            # int4 and int8 products of up to INVARIANT_ROWS rows on one arithmetic
            # (qgemm.invariant_rows), the same bound whatever the scheduler's settings, so
            # deployments with and without drafts agree on a step of any size (past it, a
            # prefill's, on the row-count paths). Set before the model is built: its expert-parallel
            # ranks take this process's paths (qgemm.paths) when they start.
            qgemm.invariant_rows(INVARIANT_ROWS)
        loaded = loaded or load_model_files(mc.name, mc.seed, mc.quantization)
        self.model_name = mc.name
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(
            mc.max_model_len or loaded.arch.max_position_embeddings, loaded.arch.max_position_embeddings
        )
        # Weights in memory are digested before packing takes them; a checkpoint on disk after the build,
        # from the samples the build's reads took (its files read once).
        early = None if digested_as_read(loaded.weights) else weights_digest(loaded.weights)
        self.model = build_model(
            loaded, mc.dtype, mc.device, self.max_model_len, mc, internal_token(config.server.internal_token)
        )
        namespace = tier_namespace(
            config, self.max_model_len, early or weights_digest(loaded.weights), loaded.arch
        )
        self.weight_bytes = getattr(self.model, "resident_weight_bytes", self.model.weight_bytes)()
        self.images = image_embeddings(loaded.vision, config) if loaded.vision is not None else None
        del loaded
        trim_heap()
        mem = memory_status()  # the loader's peak included: it streams, so near the weights' own size
        log.info(
            "model %s: %s weights, quantization %s%s, %.1f MB of weights%s",
            mc.name,
            mc.dtype,
            mc.quantization,
            " (auto: as stored)" if asked == "auto" else "",
            self.weight_bytes / 1e6,
            f", resident set {mem[0] / 1e6:.1f} MB (peak {mem[1] / 1e6:.1f} MB)" if mem else "",
        )
        dtype = kv_cache_dtype(config, self.arch)
        num_blocks = cc.device_blocks or num_blocks_for_budget(
            self.arch, cc.block_size, dtype, cc.device_memory_gb
        )
        self.block_size = cc.block_size
        self.kv_events = kv_events
        self.prefix_cache = (
            PrefixCache(cc.block_size, kv_events.on_prefix_cache if kv_events else None)
            if cc.prefix_cache
            else None
        )
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        # Expert-parallel ranks with KV pools of their own learn which blocks got new contents.
        self.pool.on_allocate = getattr(self.model, "kv_blocks_allocated", None)
        # A decode worker's pool lives in shared memory (shm_path) so that prefill workers write into it,
        # and so does an expert-parallel worker's on CPU: every rank maps it (model/expert_parallel.py).
        ep = mc.expert_parallel > 1
        if ep and shm_path is None and torch.device(mc.device).type == "cpu":
            shm_path = str(new_shm_path())
        self.kv_cache = allocate_kv_cache(self.arch, num_blocks, cc.block_size, dtype, mc.device, shm_path)
        self.kv_shm_path = shm_path  # where other processes map the pool (None: private memory)
        if ep:
            self.model.share_kv_cache(self.kv_cache, shm_path)
        # Lower tiers hold what the prefix cache evicts, named by the same hashes: no use without it.
        store = (
            TieredKVStore.from_config(
                cc,
                namespace=namespace,
                key=tier_key(config),
                listener=kv_events.on_tier if kv_events else None,
            )
            if cc.prefix_cache
            else None
        )
        self.tiers = TierFetcher(store, self.kv_cache, cc.block_size, cc.load_timeout_s) if store else None
        if self.tiers is not None and self.prefix_cache is not None:  # tiers exist only with a prefix cache
            self.prefix_cache.on_evict = self.tiers.offload
        if ep and shm_path is None and (self.tiers is not None or config.worker.role == "decode"):
            self.model.close()
            if self.tiers is not None:
                self.tiers.close()
            raise ValueError(
                "expert parallelism on a device keeps a KV cache per rank: KV written from outside "
                "the model (a decode worker's transfers, the KV tiers) would reach rank 0's only"
            )
        # Expert parallelism on a device keeps a KV cache per rank: a copy from rank 0's would be partial.
        self.swap = (
            SwapSpace(self.kv_cache, cc.block_size, int(cc.swap_space_gb * (1 << 30)))
            if cc.swap_space_gb > 0 and not (ep and shm_path is None)
            else None
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.pool,
            cc.block_size,
            config.disagg.local_prefill_max_tokens,
            self.tiers.lookup if self.tiers else None,
            self.swap,
        )
        if self.images is not None:
            self.scheduler.inputs_ready = self.images.ready
        self.connector = KVConnector()  # a role's hooks: disagg.sender / disagg.receiver
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            cc.block_size,
            Grammars(self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids),
        )
        self.requests: dict[str, Request] = {}
        self.detoks: dict[str, IncrementalDetokenizer | NoText] = {}
        self.num_steps = 0
        self.drafter = (
            DraftModel(config, self.arch.vocab_size, self.max_model_len, self.pool.num_blocks)
            if sc.speculative_method == "draft"
            else None
        )
        self.spec_draft_tokens_total = 0
        self.spec_accepted_tokens_total = 0
        self.spec_misses_total = 0  # verifications that rejected a draft (the acceptance estimate's)
        self.prefetch_bytes = self._tune_prefetch()
        # A prefill worker decodes only after a role switch: it measures then (most often reading a
        # decode worker's measurement), not beside the decode worker starting on the same host.
        adaptive = bool(self.spec_tokens and sc.speculative_adaptive)
        self._costs_later = adaptive and config.worker.role == "prefill"
        self.row_costs = self._row_costs(self.model) if adaptive and not self._costs_later else None
        self.draft_costs = (
            self._row_costs(self.drafter.model, self.drafter)
            if self.drafter is not None and sc.speculative_adaptive
            else None
        )
        self.step_counts = {"decode": 0, "prefill": 0}
        self.step_seconds = {"decode": 0.0, "prefill": 0.0}
        self.prefill_tokens_total = 0  # prompt tokens run through the model (prefix hits excluded)
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        self.recomputed_tokens_total = 0  # positions computed again after a preemption without swap

    # ------------------------------------------------------------------ requests

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        """Raise InvalidParam for a request that cannot run; nothing is allocated."""
        check_prompt(prompt_token_ids, params, self.arch.vocab_size, self.max_model_len, output_token_ids)
        if images:
            if self.images is None:
                raise InvalidParam(f"the model {self.model_name!r} takes no images", "images")
            self.images.check(images, prompt_token_ids)
        if (
            blocks_needed(len(prompt_token_ids) + (params.max_tokens or 1), self.block_size)
            > self.pool.num_blocks
        ):
            raise InvalidParam(
                f"the request needs more KV blocks than the pool holds ({self.pool.num_blocks})", "max_tokens"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prefill_peer: str | None = None,
        kv_sink: object | None = None,
        output_token_ids: list[int] | None = None,
        images: list[ImageInput] | None = None,
        upstream_tokens: int = 0,
    ) -> None:
        """`images`: a VLM prompt's images (their positions hold the image token).
        `upstream_tokens`: see Request.upstream_tokens.
        `output_token_ids`: tokens this request already generated elsewhere (a migrated stream):
        they are recomputed with the prompt and count as output for max_tokens, penalties and
        seeded draws, so the request goes on exactly as it would have where it started."""
        if request_id in self.requests:
            raise DuplicateRequestId(f"request id {request_id!r} is already running on this worker")
        self.check_request(prompt_token_ids, params, output_token_ids, images)
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            cache_salt=cache_salt,
            output_token_ids=list(output_token_ids or ()),
            images=list(images or ()),
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if params.prompt_logprobs is not None and not req.output_token_ids:
            req.prompt_logprobs = [None]  # a migrated stream had its prompt's logprobs already
        req.prefill_peers = self.connector.order_peers(prefill_peer)
        req.kv_sink = kv_sink
        req.upstream_tokens = upstream_tokens
        self.requests[request_id] = req
        self.detoks[request_id] = (
            IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
            )
            if params.detokenize
            else NoText()
        )
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        held = None
        if req.status == RequestStatus.LOADING and not (self.tiers and self.tiers.cancel(req)):
            held = self.connector.cancel_load(req)
        return self._finish(req, "abort", held=held)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.connector.has_work()

    def run_until_idle(
        self, after_step: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """Step until no request is left (the offline API, tests); every output, in order. `after_step`
        sees each step's outputs (a test checks the pool or aborts a request between steps)."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            step = self.step()
            outputs.extend(step)
            if after_step is not None:
                after_step(step)
        return outputs

    def close(self) -> None:
        """Stop the tier threads (queued writes finish first) and the KV event publisher."""
        if self.tiers is not None:
            self.tiers.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.images is not None:
            self.images.close()  # encoder processes it spawned
        if hasattr(self.model, "close"):
            self.model.close()  # expert-parallel ranks
        if self.drafter is not None:
            self.drafter.close()
        if self.core_share is not None:
            self.core_share.close()

    # ------------------------------------------------------------------ KV from peers (decode role)

    def complete_load(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        """A prefill worker filled every prompt block and sampled the first token."""
        req.prefilled_by = req.prefill_attempts[-1] if req.prefill_attempts else None
        self.scheduler.finish_loading(req)
        return self._on_token(req, token, logprob)

    def fail_load(self, req: Request, held: list[int], error: str) -> RequestOutput:
        """The transfer failed in a way no retry mends (an incompatible peer): the request ends with
        `error`; `held` blocks stay allocated for the connector to free."""
        return self._finish(req, "error", held=held, error=error)

    def retry_load(self, req: Request, held: list[int]) -> None:
        """The transfer failed: requeue the request (next prefill peer, or a local prefill)."""
        self.scheduler.abandon_loading(req, held)

    def _apply(self, events: list[ConnectorEvent]) -> list[RequestOutput]:
        """The connector's events, in order; returns the outputs they produce (first tokens, errors)."""
        outputs = []
        for ev in events:
            if isinstance(ev, LoadDone):
                if ev.prompt_logprobs is not None:
                    ev.req.prompt_logprobs = ev.prompt_logprobs
                outputs.append(self.complete_load(ev.req, ev.token, ev.logprob))
            elif isinstance(ev, LoadFailed):
                outputs.append(self.fail_load(ev.req, ev.held, ev.error))
            elif isinstance(ev, LoadRetry):
                self.retry_load(ev.req, ev.held)
            elif isinstance(ev, AddJob):
                try:
                    self.add_request(ev.request_id, ev.prompt_token_ids, ev.params, **ev.kwargs)
                except Exception as e:  # noqa: BLE001 - the peer hears why
                    ev.refused(e)
                else:
                    ev.accepted()
            elif isinstance(ev, AbortJob):
                self.abort_request(ev.request_id)
            else:
                self.pool.free(ev.blocks)
        return outputs

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        c, tiers = self.connector, self.tiers
        outputs = self._apply(c.poll(self))
        if self.images is not None:
            outputs += self._poll_images()
        if tiers is not None:
            for req, n in tiers.poll():
                self.scheduler.finish_fetch(req, n)
        drafting = 0.0  # a draft model's time: the policy counts it apart from the step's rows
        if self.spec_tokens:
            t_draft = time.perf_counter()
            self._propose_drafts()
            drafting = time.perf_counter() - t_draft
        step = self.scheduler.schedule()
        self.preemptions_total += len(step.preempted)
        for req in step.preempted:
            req.draft_tokens = []
            if self.drafter is not None:
                self.drafter.drop(req.request_id)
        for req in step.to_load:
            if req.prefill_peers:
                req.prefill_attempts.append(req.prefill_peers[0])  # the peer start_load asks
            c.start_load(req)
        for req in step.to_fetch:
            assert tiers is not None, "the scheduler fetches only through the tiers' lookup"
            tiers.start(req)
        if not step.scheduled:
            self.idle()  # waiting on peers or tiers computes nothing: the threads are free to lend
            if not outputs and tiers is not None and tiers.has_loads() and not c.has_work():
                tiers.wait(0.005)  # only tier loads can make progress now
            elif not outputs:
                c.wait(0.005)  # only peers can make progress now
            return outputs
        # Decodes, some with drafts to verify (one row each): a decode step, whatever its rows.
        decode_only = all(
            n == 1 + len(req.draft_tokens) and req.num_computed_tokens > 0 for req, n in step.scheduled
        )
        rows = sum(n for _, n in step.scheduled)
        regrant = None
        if self.core_share is not None:
            regrant = self._take_threads(decode_only)
        planned = c.begin_step(step.scheduled)
        sampled, failed = self.runner.execute(step.scheduled, self._layer_hook(planned, regrant))
        c.end_step(planned)
        self.num_steps += 1
        if self.spec_tokens:
            step.scheduled = [
                self._verified(req, n, sampled.get(req.request_id)) for req, n in step.scheduled
            ]
        prefilled, recomputed = self.scheduler.update(step)
        self.prefill_tokens_total += prefilled
        self.recomputed_tokens_total += recomputed
        for req, _ in step.scheduled:
            rid = req.request_id
            if rid in failed:
                log.warning("request %s: sampling failed: %s", rid, failed[rid])
                out = self._fail(req, f"sampling failed: {failed[rid]}")
            elif rid in sampled:
                try:
                    out = self._on_tokens(req, sampled[rid])
                except Exception as e:  # noqa: BLE001 - one request's bad token or text fails it alone
                    log.exception("request %s failed", rid)
                    out = self._fail(req, f"{type(e).__name__}: {e}")
            else:
                continue
            if req.kv_sink is None:  # a prefill job's token goes to its decode worker instead
                outputs.append(out)
        for rid in c.failed_requests():
            self.abort_request(rid)
        # Served step times, the quantity `pdserve profile` measures offline (planner/serving.py reads both).
        kind = "decode" if decode_only else "prefill"
        elapsed = time.perf_counter() - t0
        self.step_counts[kind] += 1
        self.step_seconds[kind] += elapsed
        if decode_only and self.row_costs is not None:
            self.row_costs.observe(rows, elapsed - drafting)
        return outputs

    def _take_threads(self, decode_only: bool) -> Callable[[], None] | None:
        """This step's threads: its own and those of the deployment's idle workers
        (utils/core_share.py), the kernels' results being the same on any number of them. A decode
        step takes them for the step. A prefill step, long, takes them where every product and
        attention runs on the native kernels (model.fused: the dense models; a MoE or MLA prefill's
        shapes reach torch's products, whose bits may depend on the thread count) and looks again
        after each layer (the returned callable), so a peer that gets work has its core back within a
        layer."""
        share = self.core_share
        assert share is not None
        borrows = decode_only or getattr(self.model, "fused", None) is not None
        share.set_busy(True, borrowing=borrows)
        want = share.step_threads() if borrows else share.threads
        if decode_only:
            self.borrowing_steps += want > share.threads
        else:
            self.prefill_borrowing_steps += want > share.threads
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
        if decode_only or not borrows:
            return None

        def regrant() -> None:
            now = share.step_threads()
            if now != torch.get_num_threads():
                torch.set_num_threads(now)

        return regrant

    def _layer_hook(
        self, planned: list[Request], regrant: Callable[[], None] | None
    ) -> Callable[[int], None] | None:
        """What runs after each layer of the step: the connector's layer-wise KV sends, and a
        borrowing prefill step's second look at its threads."""
        c = self.connector
        if not planned:
            return None if regrant is None else (lambda i: regrant())
        if regrant is None:
            return lambda i: c.on_layer(planned, i)

        def both(i: int) -> None:
            c.on_layer(planned, i)
            regrant()

        return both

    def idle(self) -> None:
        """Nothing to compute: this worker's threads are free for its peers' steps."""
        if self.core_share is not None:
            self.core_share.set_busy(False)

    def _poll_images(self) -> list[RequestOutput]:
        """Encoder answers in; a request whose image could not be encoded ends with the error."""
        assert self.images is not None
        self.images.poll()
        outs = []
        for rid, why in self.images.take_failed():
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                out = self._finish(req, "error")
                out.error = f"image: {why}"
                if req.kv_sink is None:
                    outs.append(out)
        return outs

    def _tune_prefetch(self) -> int | None:
        """How far ahead the decode products prefetch, measured on this model where it matters
        (engine/prefetch_tuning.py); None where the kernel's own distance stays."""
        if not prefetch_tuning.applies(self.config, self.weight_bytes) or self.pool.num_free < context_blocks(
            prefetch_tuning.CONTEXT, self.block_size
        ):
            return None
        parts = {
            **self._step_cost_parts(),
            # Threads that spin between parallel regions or sleep: the steps' pace differs.
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        }
        return prefetch_tuning.tune_prefetch(self.model, self.kv_cache, self.pool, self.block_size, parts)

    def _step_cost_parts(self, drafter: DraftModel | None = None) -> dict[str, Any]:
        """What a measured decode step's cost depends on, for the caches' keys: the model (the served
        one, or `drafter`'s) and its format, its KV cache's dtype, the kernels, the threads, torch."""
        mc, sc = self.config.model, self.config.scheduler
        return {
            "model": mc.name if drafter is None else drafter.name,
            "seed": mc.seed,
            "quantization": mc.quantization if drafter is None else sc.speculative_quantization,
            "dtype": mc.dtype,
            "device": mc.device,
            "gemm_kernel": mc.gemm_kernel,
            "activation_quantization": mc.activation_quantization if drafter is None else "none",
            "attention_kernel": mc.attention_kernel,
            "kv_dtype": str((drafter or self).kv_cache.dtype),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }

    def _row_costs(self, model, drafter: DraftModel | None = None) -> RowCosts:
        """A model's decode step cost by rows on this machine (engine/row_costs.py): cached, else
        measured now (the served model on its pool, a draft model on its own)."""
        sc = self.config.scheduler
        max_rows = max(1, min(sc.max_num_seqs * (self.spec_tokens + 1), sc.max_num_batched_tokens, 128))
        if drafter is not None:  # a draft model's steps have one row a request
            max_rows = max(1, min(sc.max_num_seqs, sc.max_num_batched_tokens, 128))
        pool = drafter.pool if drafter is not None else self.pool
        kv_cache = drafter.kv_cache if drafter is not None else self.kv_cache
        # The context each calibration row attends: a typical chat's, within what the pool can lend.
        context = max(1, min(256, self.max_model_len - 1, (pool.num_free - 1) * self.block_size - 1))
        parts = {
            **self._step_cost_parts(drafter),
            "max_rows": max_rows,
            "context": context,
        }
        key = cache_key(parts)
        costs = load_cached(key)
        if costs is not None:
            return costs
        # Workers starting together on one host take turns: the later ones read the first one's
        # measurement, and none is taken beside another (each would time the other's work).
        with measuring_alone(cache_path(key), "the decode step's row costs", ROW_COSTS_WAIT_S):
            costs = load_cached(key)
            if costs is not None:
                return costs
            t0 = time.perf_counter()
            costs = calibrate(model, kv_cache, pool, self.block_size, max_rows, context)
            save_cached(key, costs)
            log.info(
                "speculative decoding: %s decode step cost measured at %d row counts in %.1f s "
                "(1 row %.1f ms, %d rows %.1f ms)",
                parts["model"],
                len(costs.rows),
                time.perf_counter() - t0,
                costs.seconds[0] * 1e3,
                costs.rows[-1],
                costs.seconds[-1] * 1e3,
            )
        return costs

    def _propose_drafts(self) -> None:
        """Drafts for the running requests about to decode (n-gram lookups, engine/spec_decode.py, or
        a draft model's, engine/draft_model.py), each cut to what is expected to pay for its rows
        (engine/spec_policy.py)."""
        sc = self.config.scheduler
        if self._costs_later and any(
            r.kv_sink is None and r.num_computed_tokens for r in self.scheduler.running
        ):
            self._costs_later = False  # a decode here at last (a role switch): its costs now
            self.row_costs = self._row_costs(self.model)
        decoding = 0
        drafted: list[Request] = []
        depths: list[int] = []  # a draft model's: how deep each request may draft
        for req in self.scheduler.running:
            req.draft_tokens = []
            if req.num_tokens - req.num_computed_tokens != 1 or req.kv_sink is not None:
                continue
            decoding += 1
            if not eligible(req):
                continue
            room = self.max_model_len - req.num_tokens - 1
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
            if room <= 0:
                continue
            if self.drafter is not None:
                drafted.append(req)
                depths.append(min(self.spec_tokens, room))
                continue
            req.draft_tokens = propose(
                req.all_token_ids, min(self.spec_tokens, room), sc.prompt_lookup_min, sc.prompt_lookup_max
            )
            if req.draft_tokens:
                drafted.append(req)
        if not drafted:
            return
        prior = acceptance(self.spec_accepted_tokens_total, self.spec_misses_total, 0.5)
        if self.drafter is not None:
            if self.row_costs is not None and self.draft_costs is not None:
                draft_step = self.draft_costs(len(drafted))
                depths = choose(
                    decoding,
                    [(d, acceptance(r.spec_hits, r.spec_misses, prior)) for r, d in zip(drafted, depths)],
                    self.row_costs,
                    draft_cost=lambda depth: depth * draft_step,
                )
            tokens = self.drafter.propose([(r, d) for r, d in zip(drafted, depths) if d > 0])
            for req in drafted:
                req.draft_tokens = tokens.get(req.request_id, [])
        elif self.row_costs is not None:
            keep = choose(
                decoding,
                [(len(r.draft_tokens), acceptance(r.spec_hits, r.spec_misses, prior)) for r in drafted],
                self.row_costs,
            )
            for req, n in zip(drafted, keep):
                req.draft_tokens = req.draft_tokens[:n]
        for req in drafted:
            if req.draft_tokens and req.params.structured is not None:
                req.draft_tokens = self.runner.grammars.valid_drafts(req) if self.runner.grammars else []

    def _verified(
        self, req: Request, n: int, tokens: list[tuple[int, TokenLogprob | None]] | None
    ) -> tuple[Request, int]:
        """A scheduled entry with its drafts settled: the positions whose KV now holds accepted
        tokens (the last token and the accepted drafts); the rejected drafts' KV is written over later."""
        k = len(req.draft_tokens)
        if not k:
            return req, n
        req.draft_tokens = []
        accepted = max(0, len(tokens) - 1) if tokens else 0
        self.spec_draft_tokens_total += k
        self.spec_accepted_tokens_total += accepted
        missed = int(accepted < k)
        self.spec_misses_total += missed
        req.spec_hits += accepted
        req.spec_misses += missed
        if self.drafter is not None:
            self.drafter.settle(req, accepted)
        return req, n - k + accepted

    def _on_tokens(self, req: Request, tokens: list[tuple[int, TokenLogprob | None]]) -> RequestOutput:
        """One step's tokens for a request (several when drafts were accepted), as one output."""
        out = self._on_token(req, *tokens[0])
        for token, logprob in tokens[1:]:
            if out.finished:
                break
            more = self._next_output(req, token, logprob)
            out.new_token_ids += more.new_token_ids
            out.new_text += more.new_text
            out.new_logprobs += more.new_logprobs
            out.finished, out.finish_reason, out.error = more.finished, more.finish_reason, more.error
            out.num_output_tokens = more.num_output_tokens
        return out

    def _on_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        first = req.first_token_time is None
        if first:
            req.first_token_time = time.monotonic()
        out = self._next_output(req, token, logprob)
        if first and req.prompt_logprobs is not None:
            out.prompt_logprobs = list(req.prompt_logprobs)
        if first and req.prefill_attempts:
            out.prefilled_by = req.prefilled_by
            out.prefill_failures = (
                req.prefill_attempts[:-1] if req.prefilled_by else list(req.prefill_attempts)
            )
        return out

    def _next_output(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        req.append_token(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        self.generation_tokens_total += 1
        p = req.params
        reason = None
        detok = self.detoks[req.request_id]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.arch.eos_token_ids):
            reason = "stop"
        elif detok.add(token) is not None:
            reason = "stop"
        elif req.grammar is not None and req.grammar.stopped:
            reason = "stop"  # the grammar is complete: nothing more may follow
        elif p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens:
            reason = "length"
        elif req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            return self._finish(req, reason, [token], [logprob] if logprob else [])
        return RequestOutput(
            req.request_id,
            [token],
            detok.take(False),
            False,
            None,
            req.num_prompt_tokens,
            len(req.output_token_ids),
            [logprob] if logprob else [],
        )

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """End one request with `error` (its blocks freed); the engine and the batch go on."""
        if req.request_id not in self.requests:  # it had finished before the error
            return RequestOutput(
                req.request_id,
                [],
                "",
                True,
                "error",
                req.num_prompt_tokens,
                len(req.output_token_ids),
                [],
                error=error,
            )
        return self._finish(req, "error", error=error)

    def _finish(
        self,
        req: Request,
        reason: str,
        new_tokens: list[int] | None = None,
        new_logprobs: list[TokenLogprob] | None = None,
        held: list[int] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        self.scheduler.finish(req, reason, held)
        if self.images is not None:
            self.images.drop(req.request_id)
        if self.drafter is not None:
            self.drafter.drop(req.request_id)
        detok = self.detoks.pop(req.request_id)
        del self.requests[req.request_id]
        out = RequestOutput(
            req.request_id,
            new_tokens or [],
            detok.take(True),
            True,
            reason,
            req.num_prompt_tokens,
            len(req.output_token_ids),
            new_logprobs or [],
            error=error,
            scheduled_time=req.first_scheduled_time,
        )
        if req.kv_sink is not None:
            self.connector.on_finished(req, out)
        return out

    def stats(self) -> dict[str, float | str | None]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": self.pool.usage(),
            "weight_bytes": self.weight_bytes,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free,
            "preemptions_total": self.preemptions_total,
            "recomputed_tokens_total": self.recomputed_tokens_total,
            "prefill_tokens_computed": self.prefill_tokens_total,
            "prefix_cache_queried_tokens": self.prefix_cache.queried_tokens if self.prefix_cache else 0,
            "prefix_cache_hit_tokens": self.prefix_cache.hit_tokens if self.prefix_cache else 0,
            "prefix_cache_blocks": len(self.prefix_cache) if self.prefix_cache else 0,
            "loading": len(self.scheduler.loading),
            "decode_steps_total": self.step_counts["decode"],
            "decode_steps_borrowing_total": self.borrowing_steps,
            "prefill_steps_borrowing_total": self.prefill_borrowing_steps,
            "decode_step_seconds_total": self.step_seconds["decode"],
            "prefill_steps_total": self.step_counts["prefill"],
            "prefill_step_seconds_total": self.step_seconds["prefill"],
            "spec_draft_tokens_total": self.spec_draft_tokens_total,
            "spec_accepted_tokens_total": self.spec_accepted_tokens_total,
            **self.connector.stats(),
            **(self.swap.stats() if self.swap else {}),
            **(self.images.stats() if self.images else {}),
            **(self.tiers.stats() if self.tiers else {}),
            **(self._kv_event_stats(self.kv_events) if self.kv_events else {}),
        }

    @staticmethod
    def _kv_event_stats(pub: KVEventPublisher) -> dict:
        # The endpoints (strings) are for /health, where a router finds them; /metrics skips them.
        return {
            **pub.stats(),
            "kv_events_endpoint": pub.endpoint,
            "kv_events_snapshot_endpoint": pub.snapshot_endpoint,
        }
