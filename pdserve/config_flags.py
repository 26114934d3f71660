"""One table of the config keys that have a short name: `--name-with-dashes` on the pdserve command
line (cli.py) and `name=` as a keyword of the offline `LLM(...)` (engine/llm.py). Defaults stay in
config.py; this table only names keys.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.config_rules import (
    ACTIVATION_QUANTIZATIONS,
    ATTENTION_KERNELS,
    DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    TRANSFER_BACKENDS,
)


@dataclass(frozen=True)
class Flag:
    key: str  # the dotted config key
    help: str | None = None
    type: Callable[[str], Any] | None = None  # argparse's conversion (None: the string)
    choices: tuple[str, ...] | None = None
    cli: bool = True  # False: an LLM keyword only
    negative: bool = False  # a switch that is on by default: the flag is --no-<name>
    switch: bool = False  # a switch that is off by default: the flag alone turns it on


FLAGS: dict[str, Flag] = {
    "model": Flag("model.name", "smollm2-135m (default), tiny-llama, a .gguf file or a HF directory"),
    "reasoning_parser": Flag(
        "server.reasoning_parser",
        "return <think> ... </think> as reasoning_content",
        choices=REASONING_PARSERS,
    ),
    "tool_call_parser": Flag(
        "server.tool_call_parser",
        "how the model writes tool calls (default: read from the chat template)",
        choices=TOOL_CALL_PARSERS,
    ),
    "served_model_name": Flag(
        "server.served_model_name",
        "the model ids clients may send, comma-separated; the first names the model in responses (default: --model)",
    ),
    "dtype": Flag("model.dtype", choices=tuple(DTYPES)),
    "quantization": Flag(
        "model.quantization",
        "weight-only quantization of the linear layers (auto: as a GGUF file stores them, else none)",
        choices=tuple(QUANTIZATIONS),
    ),
    "attention_kernel": Flag(
        "model.attention_kernel",
        "decode attention: native kernel where it builds, or torch",
        choices=tuple(ATTENTION_KERNELS),
    ),
    "gemm_kernel": Flag(
        "model.gemm_kernel",
        "quantized products: native kernel where it builds, or torch",
        choices=tuple(ATTENTION_KERNELS),
    ),
    "activation_quantization": Flag(
        "model.activation_quantization",
        "quantized products: float32 activations (none) or quantized to int8 per row (faster, less exact)",
        choices=tuple(ACTIVATION_QUANTIZATIONS),
    ),
    "batch_invariant": Flag(
        "model.batch_invariant",
        "int4/int8 decode steps on one arithmetic at every row count: greedy output independent of the batch",
        switch=True,
    ),
    "share_idle_cores": Flag(
        "deployment.share_idle_cores",
        "PD on one machine: each worker keeps its own threads (decode steps take no idle worker's cores)",
        negative=True,
    ),
    "device": Flag("model.device", "cpu or cuda"),
    "max_model_len": Flag("model.max_model_len", type=int),
    "block_size": Flag("cache.block_size", type=int),
    "kv_cache_dtype": Flag(
        "cache.kv_dtype",
        "the KV cache's dtype: auto (bfloat16 under quantized weights, else the model's), float32, bfloat16",
    ),
    "device_memory_gb": Flag("cache.device_memory_gb", "KV cache budget", float),
    "device_blocks": Flag("cache.device_blocks", "KV blocks (overrides --device-memory-gb)", int),
    "prefix_cache": Flag("cache.prefix_cache", "turn off reuse of cached prompt prefixes", negative=True),
    "host_cache_gb": Flag(
        "cache.host_cache_gb", "host RAM tier for KV blocks evicted from the device", float
    ),
    "swap_space_gb": Flag(
        "cache.swap_space_gb", "host RAM for preempted requests' KV (0: recompute them)", float
    ),
    "disk_cache_dir": Flag(
        "cache.disk_cache_dir", "disk tier directory for KV blocks (with --disk-cache-gb)"
    ),
    "disk_cache_gb": Flag("cache.disk_cache_gb", "disk tier budget", float),
    "kv_remote": Flag("cache.remote", "shared remote KV tier, e.g. redis://127.0.0.1:6379/0"),
    "kv_events_endpoint": Flag(
        "cache.kv_events_endpoint", "publish KV events here (ZMQ PUB), e.g. tcp://127.0.0.1:5557"
    ),
    "max_num_seqs": Flag("scheduler.max_num_seqs", "cap on running requests (the decode batch cap)", int),
    "max_num_batched_tokens": Flag("scheduler.max_num_batched_tokens", "per-step token budget", int),
    "speculative_method": Flag(
        "scheduler.speculative_method",
        "speculative decoding: ngram drafts from the request's own text (prompt lookup), draft from "
        "--speculative-model, or none",
        choices=("none", "ngram", "draft"),
    ),
    "num_speculative_tokens": Flag("scheduler.num_speculative_tokens", "draft tokens per step", int),
    "speculative_model": Flag("scheduler.speculative_model", "the draft model (--speculative-method draft)"),
    "speculative_quantization": Flag(
        "scheduler.speculative_quantization",
        "the draft model's weights",
        choices=("auto", "none", "int8", "int4"),
    ),
    "enable_chunked_prefill": Flag("scheduler.enable_chunked_prefill", cli=False),
    "threads": Flag("server.threads", "torch compute threads", int),
    "seed": Flag("model.seed", "seed of tiny random model weights", int),
    "expert_parallel": Flag(
        "model.expert_parallel", "MoE models: processes sharing the experts (EP ranks)", int
    ),
    "ep_attention": Flag(
        "model.ep_attention",
        "EP ranks: data (each attends its own sequences, tokens travel to their experts) or replicated",
        choices=("data", "replicated"),
    ),
    "ep_rendezvous": Flag(
        "model.ep_rendezvous", "EP across hosts: host:port where rank 0 meets the ranks of other hosts"
    ),
    "ep_overlap": Flag(
        "model.ep_overlap",
        "EP with data attention: two micro-batches a step, one's token exchange overlapping the other's compute",
        switch=True,
    ),
    "ep_dispatch_dtype": Flag(
        "model.ep_dispatch_dtype",
        "EP with data attention: dtype of the rows sent to other ranks' experts",
        choices=("model", "bfloat16"),
    ),
    "ep_local_ranks": Flag(
        "model.ep_local_ranks",
        "EP ranks started on this host (rank 0 included); the rest: pdserve ep-rank",
        int,
    ),
    "host": Flag("server.host", "address to bind (0.0.0.0: every interface)"),
    "port": Flag("server.port", type=int),
    "insecure_admin": Flag(
        "router.insecure_admin", "let a router listen off loopback without an admin key", switch=True
    ),
    "advertise_host": Flag(
        "server.advertise_host",
        "address the router and peers reach this worker at, when "
        "--host binds every interface (default: PDSERVE_ADVERTISE_HOST, else this machine's)",
    ),
    "transfer_backend": Flag(
        "transfer.backend",
        "how KV moves from prefill to decode (mooncake, nixl: optional extras)",
        choices=tuple(TRANSFER_BACKENDS),
    ),
    "local_prefill_max_tokens": Flag(
        "disagg.local_prefill_max_tokens",
        "decode workers prefill locally when fewer prompt tokens than this are uncached",
        int,
    ),
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    for name, f in FLAGS.items():
        if not f.cli:
            continue
        dashed = name.replace("_", "-")
        if f.negative:
            parser.add_argument(f"--no-{dashed}", dest=name, action="store_false", default=None, help=f.help)
        elif f.switch:
            parser.add_argument(f"--{dashed}", dest=name, action="store_true", default=None, help=f.help)
        else:
            parser.add_argument(f"--{dashed}", type=f.type, choices=f.choices, help=f.help)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted keys the command line set (None: not given)."""
    return {f.key: getattr(args, name, None) for name, f in FLAGS.items() if f.cli}


def keyword_key(name: str) -> str:
    """The dotted key of an LLM keyword: a short name of FLAGS, or a dotted key with dots as `__`."""
    f = FLAGS.get(name)
    return f.key if f is not None else name.replace("__", ".")
