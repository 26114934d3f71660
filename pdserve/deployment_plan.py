"""The deployment a config describes: processes, roles, instance counts, threads, expert-parallel
sizes, ports, checked against the model's architecture (read without its weights).

`pdserve serve --dry-run` prints it; `pdserve serve` checks it and logs its warnings before starting
anything, and launch.py starts the workers it counts.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import Config, ConfigError, derive, for_role, load_config, shares_idle_cores

PD_ROLES = ("prefill", "decode")


@dataclass
class RolePlan:
    role: str  # prefill | decode | mixed
    instances: int
    config: Config  # what each worker of this role runs with (config.for_role, quantization resolved)

    @property
    def expert_parallel(self) -> int:
        return self.config.model.expert_parallel

    @property
    def processes(self) -> int:
        """Devices too: each EP rank is a process with a device (a share of the cores on CPU)."""
        return self.instances * self.expert_parallel


@dataclass
class Plan:
    config: Config
    arch: Any  # model.arch.ModelArch
    roles: list[RolePlan]
    warnings: list[str] = field(default_factory=list)


def _ratio(text: str) -> tuple[int, int]:
    p, d = (int(x) for x in str(text).split(":"))  # its format was checked at load
    return p, d


def pd_counts(config: Config) -> tuple[int, int, list[str]]:
    """(prefill instances, decode instances, warnings). deployment.pd_ratio is a ratio of devices
    (instances x expert_parallel) and a starting point: it sets the counts not given, as the smallest
    deployment whose whole instances fill it; counts that are given win, and a ratio they do not
    match is a warning, never a silent change."""
    d = config.deployment
    given = {r: getattr(d, r).instances for r in PD_ROLES}
    if not d.pd_ratio:
        return (
            given["prefill"] if given["prefill"] is not None else 1,
            given["decode"] if given["decode"] is not None else 1,
            [],
        )
    ep = {r: for_role(config, r).model.expert_parallel for r in PD_ROLES}
    share = dict(zip(PD_ROLES, _ratio(d.pd_ratio)))
    n = dict(given)
    if n["prefill"] is None and n["decode"] is None:
        k = math.lcm(*(ep[r] // math.gcd(share[r], ep[r]) for r in PD_ROLES))
        n = {r: k * share[r] // ep[r] for r in PD_ROLES}
    for mine, other in (PD_ROLES, PD_ROLES[::-1]):
        if n[mine] is None:  # the other count is given: this one follows the ratio, rounded up
            devices = n[other] * ep[other] * share[mine] / share[other]
            n[mine] = max(1, math.ceil(devices / ep[mine]))
    warnings = []
    dev = {r: n[r] * ep[r] for r in PD_ROLES}
    if dev["prefill"] * share["decode"] != dev["decode"] * share["prefill"]:
        g = math.gcd(dev["prefill"], dev["decode"]) or 1
        warnings.append(
            f"deployment.pd_ratio {d.pd_ratio!r} asks for prefill:decode devices of {share['prefill']}:{share['decode']}, "
            f"but the instances give {dev['prefill']}:{dev['decode']} = {dev['prefill'] // g}:{dev['decode'] // g} "
            f"(prefill {n['prefill']} x EP {ep['prefill']}, decode {n['decode']} x EP {ep['decode']}); "
            "the instance counts are used"
        )
    return n["prefill"], n["decode"], warnings


def _check_model(config: Config, arch: Any, roles: list[RolePlan]) -> None:
    problems: dict[str, str] = {}
    for rp in roles:
        ep = rp.expert_parallel
        own = rp.role in PD_ROLES and getattr(config.deployment, rp.role).expert_parallel is not None
        key = f"deployment.{rp.role}.expert_parallel" if own else "model.expert_parallel"
        if ep > 1 and not arch.is_moe:
            problems[key] = (
                f"{ep}: expert parallelism needs a MoE model, and {config.model.name} "
                f"({arch.architecture}, {arch.num_layers} layers) is dense; use a MoE model "
                "(model.name: tiny-mixtral or a Mixtral, Qwen-MoE or DeepSeek directory) or "
                "expert_parallel: 1"
            )
        elif arch.is_moe and ep > arch.num_experts + config.model.num_redundant_experts:
            problems[key] = (
                f"{ep}: {arch.num_experts + config.model.num_redundant_experts} expert slots per "
                f"layer ({arch.num_experts} experts + model.num_redundant_experts) cannot be spread "
                f"over {ep} ranks"
            )
    # Roles may quantize differently (prefill in float, decode in int4), MoE models' experts included:
    # the KV they exchange has the same layout either way, and one dtype (pd_kv_dtype).
    if problems:
        raise ConfigError(list(problems.items()))


def pd_kv_dtype(config: Config) -> str:
    """cache.kv_dtype as every worker of `config`'s PD deployment keeps it (model/kv_dtype.py). Both ends
    of a transfer hold the same dtype, and roles may quantize differently, so `auto` is resolved once,
    from the decode role: its steps read the whole cache, and prefill workers write into its pool."""
    from pdserve.model.kv_dtype import resolve_kv_dtype  # torch-free; lazily, as the router imports launch

    if config.cache.kv_dtype != "auto":
        return config.cache.kv_dtype
    try:
        return resolve_kv_dtype(for_role(config, "decode"))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError([("model.name", f"{config.model.name!r} cannot be read: {e}")]) from None


def load_worker_config(
    path: str | os.PathLike | None, overrides: dict[str, Any], role: str
) -> tuple[Config, Config]:
    """(a `pdserve worker --role R` process's config, its deployment's). The worker runs with its role's
    settings (deployment.<role>), its own flags winning over them, and with the KV dtype every worker
    of the deployment keeps (pd_kv_dtype); the deployment's config is the file and flags alone."""
    deployment = load_config(path, overrides)
    pinned = {"cache.kv_dtype": pd_kv_dtype(deployment)}
    return load_config(path, {**overrides, **pinned}, role=role), deployment


def make_plan(config: Config) -> Plan:
    """The plan of `config` (loaded, hence checked), its model read; ConfigError if they do not fit."""
    from pdserve.model.describe import describe_model  # torch-free; lazily, as the router imports launch
    from pdserve.model.stored_quant import with_resolved_quantization  # torch-free too

    try:
        arch = describe_model(config.model.name)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError([("model.name", f"{config.model.name!r} cannot be read: {e}")]) from None
    warnings: list[str] = []
    if config.deployment.mode == "pd":
        n_prefill, n_decode, warnings = pd_counts(config)
        kv = {"cache.kv_dtype": pd_kv_dtype(config)}
        roles = [
            RolePlan(r, n, with_resolved_quantization(derive(for_role(config, r), kv)))
            for r, n in zip(PD_ROLES, (n_prefill, n_decode))
        ]
    else:
        roles = [RolePlan("mixed", 1, with_resolved_quantization(config))]
        d = config.deployment
        if d.pd_ratio or any(v is not None for r in PD_ROLES for v in vars(getattr(d, r)).values()):
            warnings.append(
                "deployment.pd_ratio and deployment.prefill/decode apply to deployment.mode pd; "
                "mode mixed runs one process with the global settings"
            )
    _check_model(config, arch, roles)
    return Plan(config, arch, roles, warnings)


def _kv(c: Config, arch: Any, auto: bool) -> str:
    """The role's KV budget and the dtype its cache holds, `(auto)` where the config left it."""
    from pdserve.model.kv_dtype import resolve_kv_dtype

    size = f"{c.cache.device_blocks} blocks" if c.cache.device_blocks else f"{c.cache.device_memory_gb:g} GB"
    kv = resolve_kv_dtype(c, arch)
    return f"{size}, {kv}{' (auto)' if auto else ''}"


def _quantization(config: Config, rp: RolePlan) -> str:
    """The role's quantization as resolved, and `(auto)` where the config left it to the stored weights."""
    q = str(getattr(rp.config.model, "quantization", "none"))
    given = (for_role(config, rp.role) if rp.role in PD_ROLES else config).model.quantization
    return f"{q} (auto)" if given == "auto" else q


def format_plan(plan: Plan) -> str:
    c, a = plan.config, plan.arch
    moe = (
        f"MoE, {a.num_experts} experts top-{a.num_experts_per_tok} in {len(a.moe_layer_ids())} layers"
        if a.is_moe
        else "dense"
    )
    if a.is_mla:  # what each token of each layer costs in the KV pool
        moe += f", MLA (KV: latent {a.kv_lora_rank} + rope {a.qk_rope_head_dim} per token)"
    out = [
        f"model: {c.model.name} ({a.architecture}, {a.num_layers} layers, {moe}, context "
        f"{c.model.max_model_len or a.max_position_embeddings}); dtype {c.model.dtype}, device {c.model.device}"
    ]
    rows = [
        [
            "role",
            "instances",
            "EP",
            "processes",
            "threads",
            "max_num_seqs",
            "max_batched_tokens",
            "KV cache",
            "quantization",
            "cores",
        ]
    ]
    for rp in plan.roles:
        rc = rp.config
        cores = getattr(c.deployment, rp.role).cpu_affinity if rp.role in PD_ROLES else None
        rows.append(
            [
                rp.role,
                str(rp.instances),
                str(rp.expert_parallel),
                str(rp.processes),
                str(rc.server.threads or "torch default"),
                str(rc.scheduler.max_num_seqs),
                str(rc.scheduler.max_num_batched_tokens),
                _kv(rc, a, c.cache.kv_dtype == "auto"),
                _quantization(c, rp),
                ",".join(map(str, cores)) if cores else "any",
            ]
        )
    host, port = c.server.host, c.server.port
    if c.deployment.mode == "pd":
        enc = c.router.encoder_workers
        n = 1 + enc + sum(rp.processes for rp in plan.roles)
        out.append(
            f"mode: pd, {n} processes: a router with {enc} encoder process(es), "
            + " and ".join(
                f"{rp.instances} {rp.role} worker(s) of {rp.expert_parallel} EP rank(s)" for rp in plan.roles
            )
        )
        out.append(
            f"routing: prefill {c.load_balancer.prefill}, decode {c.load_balancer.decode}; transfer "
            f"{c.transfer.backend}, bandwidth limit {c.transfer.bandwidth_limit or 'none'}; prefix cache "
            f"{'on' if c.cache.prefix_cache else 'off'}"
        )
        out.append(
            f"ports: router {host}:{port}; each worker binds free ports on 127.0.0.1 (HTTP, KV transfer, "
            "KV events; shown in its /health), each EP group a free port for its process group"
        )
    else:
        n = sum(rp.processes for rp in plan.roles)
        out.append(
            f"mode: mixed, {n} process(es): one server that prefills and decodes"
            + (f", with {n - 1} more EP rank(s)" if n > 1 else "")
        )
        out.append(
            f"ports: {host}:{port}" + ("; the EP ranks a free port for their process group" if n > 1 else "")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    threads = sum(rp.processes * (rp.config.server.threads or 1) for rp in plan.roles)
    out.append(f"compute threads in all: {threads} (this machine has {os.cpu_count()} cores)")
    if c.deployment.mode == "pd":
        out.append(
            "idle cores: "
            + (
                "lent to decode steps (a worker with nothing to do lends its threads; not to EP workers)"
                if shares_idle_cores(c)
                else "not shared (each worker on its own threads)"
            )
        )
    out += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(out)
