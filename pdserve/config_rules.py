"""What each config value may be, checked when a config loads (config.load_config): the type from
config.py's annotations, then the allowed values, the range or the format below. Every number
without a rule of its own must be >= 0. A bad value raises ConfigError naming its key, the value
and what is allowed; the CLI turns that into exit status 2.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pdserve.common.reasoning import PARSERS
from pdserve.common.tool_parsers import PARSERS as TOOL_PARSERS

if TYPE_CHECKING:  # config imports this module at load; the rules only read a Config's fields
    from pdserve.config import Config


class ConfigError(ValueError):
    """Bad config: `problems` lists (dotted key, what is wrong with its value)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(f"{key}: {msg}" for key, msg in self.problems))


DTYPES = ("float32", "bfloat16", "float16")
# auto: as the weights are stored (model/stored_quant.py), resolved when the model is read.
QUANTIZATIONS = ("auto", "none", "int8", "int4")
ATTENTION_KERNELS = ("auto", "torch")
ACTIVATION_QUANTIZATIONS = ("none", "int8")  # model/kernels/qgemm_q8.c
TRANSFER_BACKENDS = ("auto", "shm", "tcp", "mooncake", "nixl")
MODES = ("pd", "mixed")
EP_ATTENTION = ("data", "replicated")  # model/dp_attention.py, model/expert_parallel.py
EP_DISPATCH_DTYPES = ("model", "bfloat16")  # model/ep_exchange.py
WORKER_ROLES = ("mixed", "prefill", "decode")
# Other engines' workers a router can front (router/front.py): their OpenAI API, metrics and KV events.
ENGINES = ("vllm", "sglang")
ENGINE_WORKER_KEYS = ("kv_events_endpoint", "kv_events_replay_endpoint")
CONTROLLER_BACKENDS = ("local", "kubernetes", "hosts")
# The router's policies (router/policies.py POLICIES). Config never imports the router; a test keeps
# the two lists equal.
POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware", "cost")
REASONING_PARSERS = PARSERS  # common/reasoning.py
TOOL_CALL_PARSERS = tuple(
    k for k in TOOL_PARSERS if k != "json"
)  # common/tool_parsers (json: tool_choice's own)
_ROLES = ("prefill", "decode")


def _per_role(rules: dict[str, Any]) -> dict[str, Any]:
    """deployment.<role>.x rules, written once for both roles."""
    return {k.replace("<role>", r): v for k, v in rules.items() for r in _ROLES}


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPES,
    "model.ep_attention": EP_ATTENTION,
    "model.ep_dispatch_dtype": EP_DISPATCH_DTYPES,
    "model.quantization": QUANTIZATIONS,
    "model.attention_kernel": ATTENTION_KERNELS,
    "model.gemm_kernel": ATTENTION_KERNELS,
    "model.activation_quantization": ACTIVATION_QUANTIZATIONS,
    "transfer.backend": TRANSFER_BACKENDS,
    "deployment.mode": MODES,
    "load_balancer.prefill": POLICIES,
    "load_balancer.decode": POLICIES,
    "worker.role": WORKER_ROLES,
    "controller.backend": CONTROLLER_BACKENDS,
    "server.reasoning_parser": REASONING_PARSERS,
    "server.tool_call_parser": TOOL_CALL_PARSERS,
    "scheduler.speculative_method": ("none", "ngram", "draft"),
    "scheduler.speculative_quantization": QUANTIZATIONS,
    "cache.kv_events_format": ("pdserve", "vllm", "vllm-array"),  # cache/kv_events_vllm.py FORMATS
    "cache.kv_dtype": ("auto", "float32", "bfloat16"),
    **_per_role({"deployment.<role>.quantization": QUANTIZATIONS}),
}


@dataclass(frozen=True)
class Bound:
    low: float = 0
    high: float | None = None
    above: bool = False  # `low` itself is not allowed

    def ok(self, v: float) -> bool:
        return (v > self.low if self.above else v >= self.low) and (self.high is None or v <= self.high)

    def __str__(self) -> str:
        if self.high is not None:
            return f"from {self.low:g} to {self.high:g}"
        return f"above {self.low:g}" if self.above else f"at least {self.low:g}"


_ONE, _POSITIVE, _PORT = Bound(1), Bound(0, above=True), Bound(0, 65535)
BOUNDS: dict[str, Bound] = {
    "model.max_model_len": _ONE,
    "model.expert_parallel": _ONE,
    "model.ep_local_ranks": _ONE,
    "model.ep_timeout_s": _POSITIVE,
    "model.eplb_window": _ONE,
    "model.eplb_threshold": Bound(1.0),
    "cache.block_size": _ONE,
    "cache.device_memory_gb": _POSITIVE,
    "cache.device_blocks": _ONE,
    "cache.remote_ttl_s": _ONE,
    "cache.load_timeout_s": _POSITIVE,
    "scheduler.max_num_seqs": _ONE,
    "scheduler.max_num_batched_tokens": _ONE,
    "scheduler.num_speculative_tokens": Bound(1, 16),
    "scheduler.prompt_lookup_min": Bound(1, 16),
    "scheduler.prompt_lookup_max": Bound(1, 16),
    "server.port": _PORT,
    "server.threads": _ONE,
    "server.max_body_bytes": _ONE,
    "disagg.bootstrap_timeout_s": _POSITIVE,
    "disagg.queue_timeout_s": _POSITIVE,
    "disagg.transfer_timeout_s": _POSITIVE,
    "disagg.quarantine_timeout_s": _POSITIVE,
    "deployment.decode.instances": _ONE,  # a PD deployment needs a decode worker; prefill may be 0
    **_per_role(
        {
            "deployment.<role>.threads": _ONE,
            "deployment.<role>.expert_parallel": _ONE,
            "deployment.<role>.max_num_seqs": _ONE,
            "deployment.<role>.max_num_batched_tokens": _ONE,
            "deployment.<role>.device_memory_gb": _POSITIVE,
            "deployment.<role>.device_blocks": _ONE,
        }
    ),
    "router.requests_per_minute": _ONE,
    "router.tokens_per_minute": _ONE,
    "router.max_prompt_tokens": _ONE,
    "router.max_concurrent": _ONE,
    "router.queue_timeout_s": _POSITIVE,
    "router.connect_timeout_s": _POSITIVE,
    "router.request_timeout_s": _POSITIVE,
    "router.breaker_failures": _ONE,
    "router.health_period_s": _POSITIVE,
    "router.heartbeat_timeout_s": _POSITIVE,
    "worker.kv_port": _PORT,
    "controller.interval_s": _POSITIVE,
    "controller.slo_ttft_ms": _POSITIVE,
    "controller.slo_tpot_ms": _POSITIVE,
    "controller.kv_usage_high": Bound(0, 1, above=True),
    "controller.high": _POSITIVE,
    "controller.low": _POSITIVE,
    "controller.sustain_intervals": _ONE,
    "controller.min_workers": Bound(2),
    "controller.max_workers": Bound(2),
    "controller.switch_gain": Bound(1),
    "controller.lease_s": Bound(3),
    "rollout.canary_weight": Bound(0, 1),
    "rollout.window_s": _POSITIVE,
    "rollout.slo_ttft_ms": _POSITIVE,
    "rollout.slo_tpot_ms": _POSITIVE,
    "rollout.max_error_rate": Bound(0, 1),
    "rollout.health_timeout_s": _POSITIVE,
    "vision.max_image_bytes": _ONE,
    "vision.max_image_pixels": _ONE,
    "vision.remote_timeout_s": _POSITIVE,
    "vision.encode_timeout_s": _POSITIVE,
}


# ------------------------------------------------------------------ formats: value -> problem or None


def _pd_ratio(v: Any) -> str | None:
    if isinstance(v, int):  # YAML 1.1 reads an unquoted 1:1 as 61 (base 60)
        return (
            f'{v!r} is not a ratio: write it quoted, e.g. "1:1" (YAML reads an unquoted 1:1 as the number 61)'
        )
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", v)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        return f'{v!r} is not a ratio; allowed: "P:D" with whole numbers >= 1, e.g. "1:2"'
    return None


def _bandwidth(v: Any) -> str | None:
    allowed = (
        'allowed: bytes per second (a number >= 0) or a percentage of the measured memcpy speed, e.g. "50%"'
    )
    if isinstance(v, str):
        text = v.strip()
        try:
            x = float(text[:-1]) if text.endswith("%") else float(text)
        except ValueError:
            return f"{v!r} is not a bandwidth; {allowed}"
        if text.endswith("%") and not 0 < x <= 100:
            return f"{v!r} is not a percentage from 0 to 100; {allowed}"
    else:
        x = v
    return f"{v!r} is negative; {allowed}" if x < 0 else None


def _device(v: str) -> str | None:
    if re.fullmatch(r"(cpu|cuda|xpu|mps)(:\d+)?", v):
        return None
    return f"{v!r} is not a device; allowed: cpu, cuda, cuda:N, xpu, xpu:N, mps"


def _host_port(v: str) -> str | None:
    m = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[^\s:/\[\]]+):(\d{1,5})", v)
    if m and 0 < int(m.group(2)) < 65536 and m.group(1) not in ("0.0.0.0", "[::]"):
        return None
    return f"{v!r} is not host:port; allowed: an address of this host and a port, e.g. 10.0.0.2:29500"


def _non_empty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def _remote(v: str) -> str | None:
    if re.match(r"(redis|rediss|unix)://", v):
        return None
    return f"{v!r} is not a Redis URL; allowed: redis://host:port/db, rediss://..., unix://path"


def _zmq_endpoint(v: str) -> str | None:
    if re.fullmatch(r"(tcp|ipc|inproc)://.+", v):
        return None
    return f"{v!r} is not a ZMQ endpoint; allowed: tcp://host:port (port * = a free one), ipc://path"


def _zmq_endpoints(v: list[str]) -> str | None:
    return next((p for p in map(_zmq_endpoint, v) if p), None)


def _router_url(v: str) -> str | None:
    bad = [u for u in v.split(",") if not re.fullmatch(r"https?://[^\s/]+.*", u.strip())]
    return f"{bad[0]!r} is not an http(s) URL; allowed: http://host:port, comma-separated" if bad else None


def _http_url(v: str) -> str | None:
    return (
        None
        if re.fullmatch(r"https?://[^\s/]+.*", v)
        else f"{v!r} is not an http(s) URL; allowed: http://host:port"
    )


def _cidrs(v: list[str]) -> str | None:
    for c in v:
        try:
            ipaddress.ip_network(c, strict=False)
        except ValueError:
            return f"{c!r} is not an IP network; allowed: CIDRs such as 10.0.0.0/8 or 127.0.0.1"
    return None


def _workers(v: list[dict]) -> str | None:
    roles = (*WORKER_ROLES, *ENGINES)
    for w in v:
        if not isinstance(w.get("url"), str) or not re.match(r"https?://", w["url"]):
            return f"{w!r} needs url: http(s)://host:port"
        role = w.get("role", "mixed")
        if role not in roles:
            return f"{w!r}: role {role!r} is not allowed; allowed: {', '.join(roles)}"
        known = {"url", "role", *(ENGINE_WORKER_KEYS if role in ENGINES else ())}
        if set(w) - known:
            return f"{w!r}: unknown keys {sorted(set(w) - known)}; known: {', '.join(sorted(known))}"
        for key in ENGINE_WORKER_KEYS:
            if key in w and (not isinstance(w[key], str) or _zmq_endpoint(w[key]) is not None):
                return f"{w!r}: {key} {w[key]!r} is not a ZeroMQ endpoint (tcp://host:port)"
    if len({w.get("role", "mixed") in ENGINES for w in v}) > 1:
        return "vLLM/SGLang workers and pdserve workers cannot be mixed behind one router"
    return None


def _cores(v: list[int]) -> str | None:
    return f"{v!r}: core numbers are >= 0" if any(c < 0 for c in v) else None


FORMATS: dict[str, Callable[[Any], str | None]] = {
    "model.name": _non_empty,
    "model.device": _device,
    "model.ep_rendezvous": _host_port,
    "cache.remote": _remote,
    "router.shared_limits": _remote,
    "controller.leader_lease": _remote,
    "cache.kv_events_endpoint": _zmq_endpoint,
    "cache.kv_events_snapshot_endpoint": _zmq_endpoint,
    "server.router_url": _router_url,
    "server.otlp_endpoint": _http_url,
    "disagg.prefill_endpoints": _zmq_endpoints,
    "transfer.bandwidth_limit": _bandwidth,
    "deployment.pd_ratio": _pd_ratio,
    "router.workers": _workers,
    "router.ip_allowlist": _cidrs,
    "vision.remote_url_allow_networks": _cidrs,
    "vision.encoder_endpoints": _zmq_endpoints,
    **_per_role({"deployment.<role>.cpu_affinity": _cores}),
}


# ------------------------------------------------------------------ types


def _type_ok(v: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(v, a) for a in args)
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    if tp is dict or origin is dict:
        return isinstance(v, dict)
    if tp is list or origin is list:
        return isinstance(v, list) and all(_type_ok(x, args[0]) for x in v) if args else isinstance(v, list)
    return True  # an annotation this checker does not know: left to the code that reads it


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return (
            f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
        )
    return {
        type(None): "null",
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
    }.get(tp, str(tp))


def _check_value(key: str, v: Any, tp: Any) -> str | None:
    if not _type_ok(v, tp):
        if key == "deployment.pd_ratio" and isinstance(v, int):
            return _pd_ratio(v)
        return f"{v!r} is not allowed; allowed: {_type_name(tp)}"
    if v is None:
        return None
    if key in CHOICES and v not in CHOICES[key]:
        return f"{v!r} is not allowed; allowed: {', '.join(CHOICES[key])}"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        bound = BOUNDS.get(key, Bound(0))
        if not bound.ok(v):
            return f"{v!r} is out of range; allowed: {bound}"
    if key in FORMATS:
        return FORMATS[key](v)
    return None


def problems(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(key, problem) for every bad value in the dataclass tree `obj`."""
    out: list[tuple[str, str]] = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, v = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out += problems(v, key + ".")
        elif (p := _check_value(key, v, hints[f.name])) is not None:
            out.append((key, p))
    return out


def _ep_problems(cfg: Config) -> list[tuple[str, str]]:
    """Expert parallelism across hosts: a worker with ranks on other hosts (fewer model.ep_local_ranks
    than its expert_parallel, the global one or its role's) needs a rendezvous and data-parallel
    attention (replicated attention maps one host's KV pool)."""
    m = cfg.model
    if m.ep_local_ranks is None:
        return []
    worlds = [m.expert_parallel] + [
        r.expert_parallel for r in (cfg.deployment.prefill, cfg.deployment.decode) if r.expert_parallel
    ]
    if not any(m.ep_local_ranks < w for w in worlds):
        return []
    if not m.ep_rendezvous:
        return [
            (
                "model.ep_rendezvous",
                "is not set; allowed: host:port of rank 0 when model.ep_local_ranks is below "
                "expert_parallel (ranks on other hosts join there)",
            )
        ]
    if m.ep_attention != "data":
        return [
            (
                "model.ep_attention",
                f"{m.ep_attention!r} needs every rank on one host; allowed: data when "
                "model.ep_local_ranks is below expert_parallel",
            )
        ]
    return []


def _overlap_problems(cfg: Config) -> list[tuple[str, str]]:
    """Two micro-batches overlap the token exchange of data-parallel attention: replicated attention
    exchanges nothing."""
    m = cfg.model
    if m.ep_overlap and m.ep_attention != "data":
        return [
            (
                "model.ep_overlap",
                f"true needs model.ep_attention: data (it is {m.ep_attention!r}); allowed: false",
            )
        ]
    return []


def check(cfg: Config) -> None:
    """Raises ConfigError listing every bad value of `cfg`."""
    found = problems(cfg)
    r = cfg.router
    if bool(r.tls_cert) != bool(r.tls_key):
        found.append(
            (
                "router.tls_cert" if not r.tls_cert else "router.tls_key",
                "router.tls_cert and router.tls_key go together: set both or neither",
            )
        )
    c = cfg.controller
    if c.min_workers > c.max_workers:
        found.append(
            (
                "controller.min_workers",
                f"{c.min_workers} is above controller.max_workers ({c.max_workers}); "
                f"allowed: at most controller.max_workers",
            )
        )
    if c.low >= c.high:
        found.append(
            (
                "controller.low",
                f"{c.low:g} is not below controller.high ({c.high:g}); allowed: low < high "
                "(the gap between them is the hysteresis)",
            )
        )
    if c.backend == "hosts":
        bad = [a for a in c.agents if not a.startswith(("http://", "https://"))]
        if not c.agents or bad:
            found.append(
                (
                    "controller.agents",
                    (f"{bad[0]!r} is not a URL; " if bad else "is empty; ")
                    + "allowed: the URL of each worker host's agent (`pdserve agent`), "
                    "e.g. http://10.0.0.3:7070, when controller.backend is hosts",
                )
            )
    found += _ep_problems(cfg)
    found += _overlap_problems(cfg)
    sc = cfg.scheduler
    if sc.speculative_method == "draft" and not sc.speculative_model:
        found.append(
            (
                "scheduler.speculative_model",
                "is not set; allowed: a model name (as model.name takes it) when "
                "scheduler.speculative_method is draft",
            )
        )
    if sc.prompt_lookup_min > sc.prompt_lookup_max:
        found.append(
            (
                "scheduler.prompt_lookup_min",
                f"{sc.prompt_lookup_min} is above scheduler.prompt_lookup_max ({sc.prompt_lookup_max}); "
                "allowed: at most scheduler.prompt_lookup_max",
            )
        )
    if found:
        raise ConfigError(found)
