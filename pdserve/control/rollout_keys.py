"""What `POST /admin/workers` may set in a new worker's config (control/rollout_api.py: a rollout's
new version), and what the deployment keeps.

A caller of the admin API chooses what a worker computes: the model's and the engine's settings,
its KV budget and its local tiers, its role's settings. It never chooses where the worker talks or
whom it trusts: its router, its peers' and encoders' endpoints, the remote KV tier, the trace
collector, remote image fetches, the disk tier's directory, its ports and its secrets (a worker the
router starts holds the internal token: pointed elsewhere, it would present it there, or ship KV
and prompts out). Those keep the deployment's values, and a submitted value that differs from them
is refused, naming the key; so is one that differs from the default where the default would do
(a key the version label leaves out, such as a port). The router's own sections (router,
controller, rollout) are the router's, not the worker's: the deployment's are kept, whatever came.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from pdserve.config import Config, ConfigError, derive
from pdserve.version import config_digest

# Whole sections a new version may set.
SECTIONS = ("model", "scheduler", "deployment", "load_balancer")
# Single keys a new version may set; every other key of a worker's config is the deployment's.
KEYS = frozenset(
    {
        "cache.block_size",
        "cache.device_memory_gb",
        "cache.device_blocks",
        "cache.prefix_cache",
        "cache.host_cache_gb",
        "cache.disk_cache_gb",
        "cache.remote_ttl_s",
        "cache.load_timeout_s",
        "cache.swap_space_gb",
        "server.served_model_name",
        "server.threads",
        "server.shutdown_timeout_s",
        "server.max_body_bytes",
        "disagg.local_prefill_max_tokens",
        "disagg.bootstrap_timeout_s",
        "disagg.queue_timeout_s",
        "disagg.transfer_timeout_s",
        "disagg.quarantine_timeout_s",
        "disagg.peer_retry_s",
        "disagg.parallel_prefill_min_tokens",
        "disagg.parallel_prefill_attention_weight",
        "transfer.backend",
        "transfer.bandwidth_limit",
        "transfer.layerwise",
        "vision.max_images",
        "vision.max_image_bytes",
        "vision.max_image_pixels",
        "vision.remote_timeout_s",
        "vision.encoder_processes",
        "vision.encode_timeout_s",
    }
)
ROUTER_SECTIONS = ("router", "controller", "rollout")


def _get(cfg: Config, key: str) -> Any:
    section, leaf = key.split(".")
    return getattr(getattr(cfg, section), leaf)


def rollout_worker_config(deployment: Config, new: Config) -> Config:
    """`new` (a loaded config from the admin API) with the deployment's value of every key it may not
    set; ConfigError names each key it tried to change."""
    default = Config()
    kept: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for section in fields(Config):
        if section.name in SECTIONS:
            continue
        if section.name in ROUTER_SECTIONS:
            kept[section.name] = getattr(deployment, section.name)
            continue
        for leaf in fields(getattr(default, section.name)):
            key = f"{section.name}.{leaf.name}"
            if key in KEYS:
                continue
            mine, theirs = _get(deployment, key), _get(new, key)
            kept[key] = mine
            if theirs == mine or (
                theirs == _get(default, key) and config_digest(derive(new, {key: mine})) == config_digest(new)
            ):
                continue
            problems.append(
                (
                    key,
                    "is the deployment's to set, not the admin API's: a new version may change what "
                    "a worker computes, not where it connects or what it trusts",
                )
            )
    if problems:
        raise ConfigError(problems)
    return derive(new, kept)
