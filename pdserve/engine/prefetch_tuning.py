"""How far ahead a decode step's quantized products prefetch their weights, chosen on the served model.

A batch-1 decode step streams every weight once; the native kernel's register rows ask for each
weight's lines some bytes ahead of reading them (qgemm.prefetch), and how far ahead pays depends on
the machine's memory and on the model's shapes: on one Zen 5, 4 KB was fastest for SmolLM2-135M's
steps and 8 KB for a Llama-3.2-1B-shaped model's, where the kernel's unmeasured 2 KB ran 1.3x
slower (docs/benchmarks.md). So the engine times its own model's batch-1 steps at a few distances
when it starts (kernels/tuning.measure_prefetch), on KV blocks borrowed from its pool and returned,
and caches the choice per CPU, kernel build, model, format and threads. Where the weights fit the
cores' own caches, or the products are not the native register rows', nothing is measured: the
distance changes nothing there. A cache the cores share is no such place: weights that fit it still
stream (a VM's shared L3 is the host socket's; on one reporting 480 MB, SmolLM2's 95 MB of int4
steps ran faster at 4 KB than at 2 KB, docs/benchmarks.md). A product's results never depend on it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from pdserve.common.paths import cache_root, save_json
from pdserve.engine.row_costs import cache_key, context_blocks, decode_step
from pdserve.model.kernels import qgemm, tuning
from pdserve.utils.cpu import core_cache_bytes

log = logging.getLogger(__name__)
FORMAT = "pdserve-prefetch/1"
CONTEXT = 64  # tokens each timed step attends to: a short chat's, so that the weights dominate


def applies(config, weight_bytes: int, min_bytes: int | None = None) -> bool:
    """Whether the model's decode products take the register rows and stream from memory: int4 or int8
    weights (a quantized model's output head is int8 too) with float activations, the native kernel,
    one process, weights over twice the threads' own caches together (`min_bytes` instead, where
    given)."""
    mc = config.model
    return (
        mc.device == "cpu"
        and mc.gemm_kernel == "auto"
        and mc.quantization in ("int4", "int8")
        and mc.activation_quantization == "none"
        and mc.expert_parallel <= 1
        and qgemm.available()
        and weight_bytes > (_own_cache_bytes(config) * 2 if min_bytes is None else min_bytes)
    )


def _own_cache_bytes(config) -> int:
    """The step's threads' own caches together."""
    return (config.server.threads or torch.get_num_threads()) * core_cache_bytes()


def _path(key: str):
    return cache_root() / "kernels" / f"prefetch-{key}.json"


def _read(key: str) -> int | None:
    path = _path(key)
    try:
        return int(json.loads(path.read_text())["prefetch_bytes"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable prefetch tuning %s: %s", path, e)
        return None


def _write(key: str, chosen: int, seconds: dict[int, float]) -> None:
    data = {
        "format": FORMAT,
        "prefetch_bytes": chosen,
        "step_ms": {str(b): s * 1e3 for b, s in seconds.items()},
    }
    save_json(_path(key), data, "the prefetch tuning")


def tune_prefetch(model, kv_cache: torch.Tensor, pool, block_size: int, parts: dict[str, Any]) -> int:
    """The distance this model's batch-1 steps ran fastest at (cached under `parts`, else measured
    now), applied to the kernel; returned."""
    key = cache_key({"what": "prefetch", **parts})
    chosen = _read(key)
    if chosen is None:
        t0 = time.perf_counter()
        blocks = pool.allocate(context_blocks(CONTEXT, block_size))
        try:
            step = decode_step(
                model, kv_cache, blocks, block_size, 1, CONTEXT, torch.Generator().manual_seed(0)
            )
            seconds = tuning.measure_prefetch(step)
        finally:
            pool.free(blocks)
        chosen = tuning.choose_prefetch(seconds)
        _write(key, chosen, seconds)
        log.info(
            "decode products prefetch %d bytes ahead (batch-1 step ms by distance: %s; measured in %.1f s)",
            chosen,
            {b: round(s * 1e3, 2) for b, s in seconds.items()},
            time.perf_counter() - t0,
        )
    qgemm.prefetch(chosen)
    return chosen
