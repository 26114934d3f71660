"""Typed configuration: the one source of defaults, loaded from YAML and overridden by flags.

A loaded Config is frozen: a process that needs other values (its bound port, a worker's role)
derives its own copy with `derive`, and nothing changes a config another part already holds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config_rules import ConfigError, check
from pdserve.config_yaml import leaves_of, nest_dotted, read_yaml, set_leaves


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m"  # a built-in name, a GGUF file or a Hugging Face directory
    dtype: str = "float32"  # float32 (CPU default) or bfloat16
    # Weight-only quantization of the linear layers: none, int8 (per output channel) or int4
    # (groups of 32 with scale and offset; the default model's Q4_1 tensors load as they are).
    # auto: as the weights are stored (a GGUF file's Q4_0/Q4_1 int4, Q8_0 int8; float files, Hugging
    # Face directories and the tiny random models none), resolved when the model is read.
    quantization: str = "auto"
    # auto: native kernels (C, built with the system compiler on first use; torch's path where none builds)
    attention_kernel: str = (
        "auto"  # decode and prefill attention reading the paged KV in place (float32, CPU); or torch
    )
    gemm_kernel: str = "auto"  # quantized products, float32 activations not rounded (CPU); or torch
    # int4 and int8 products on CPU: none keeps the activations float32; int8 quantizes each row to int8
    # in blocks of 32 (a scale each) and multiplies in integers, as llama.cpp does: faster, a little less
    # exact (a row's result never depends on the rows beside it). float32 weights keep float activations.
    activation_quantization: str = "none"
    # int4 and int8 products of a decode step's size (up to 256 rows) on one arithmetic, their exact
    # path from 1 row (AMX's exact tiles, AVX512-BF16's exact pairs, else the float32 kernel's
    # dequantized block), so a row's result does not depend on how many rows share its step: greedy
    # output then does not depend on the batch. Slower at a few rows and at 32 or more where the
    # exact path is not the fastest. On with speculative decoding, whose verify steps need it.
    batch_invariant: bool = False
    device: str = "cpu"  # cpu or cuda
    max_model_len: int | None = None  # defaults to the model's context length
    seed: int = 0  # weights of the tiny random models
    # MoE models: ranks (processes) sharing the experts.
    expert_parallel: int = 1
    # data: each rank attends its own share of the sequences and the MoE layers send tokens only to the
    # ranks holding their experts (all-to-all); replicated: every rank attends every token and the MoE
    # outputs are summed with an all-reduce. Replicated needs every rank on one host.
    ep_attention: str = "data"
    # EP across hosts: "host:port" where rank 0 meets the ranks of other hosts (host: rank 0's address
    # on the network they share); None: every rank on this host. With it, ep_local_ranks ranks start
    # here (rank 0 included) and ranks ep_local_ranks..expert_parallel-1 join with `pdserve ep-rank`.
    ep_rendezvous: str | None = None
    ep_local_ranks: int | None = None  # None (or expert_parallel or more): every rank on this host
    # Deadline of each exchange between EP ranks: a rank silent this long (lost, stopped, cut off) fails
    # the worker, whose /health then says so.
    ep_timeout_s: float = 60.0
    # Two micro-batches a step with data-parallel attention, one's token exchange in flight while the
    # other computes (as SGLang's two-batch overlap); each reads the rank's experts, so it pays only
    # where the waits it hides cost more than a second read of the experts (docs/eplb.md).
    ep_overlap: bool = False
    # The dtype a token's hidden state travels in to the ranks holding its experts (data attention):
    # model (its own) or bfloat16 (half a float32 model's dispatch bytes; those experts then see it
    # rounded to bfloat16). Their results come back in the model's dtype.
    ep_dispatch_dtype: str = "model"
    num_redundant_experts: int = 0  # extra physical expert slots per MoE layer, for replicas of hot experts
    eplb_interval: int = 32  # steps between imbalance checks of the expert balancer; 0 = off
    eplb_window: int = 256  # steps in the expert-load heatmap
    eplb_threshold: float = 1.2  # rebalance when max/mean rank load stays above this


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    device_memory_gb: float = 1.0  # KV pool budget; ignored when device_blocks is set
    device_blocks: int | None = None  # KV pool size in blocks (overrides device_memory_gb)
    prefix_cache: bool = True  # reuse the KV of cached prompt prefixes (radix tree)
    host_cache_gb: float = 0.0  # RAM tier for blocks evicted from the device pool; 0 = off
    disk_cache_dir: str | None = None  # disk tier directory (one file per block); None = off
    disk_cache_gb: float = 0.0  # disk tier budget; 0 = off
    remote: str | None = None  # shared remote tier, e.g. redis://127.0.0.1:6379/0; None = off
    remote_ttl_s: int | None = None  # expiry of remote blocks; None keeps them until Redis evicts
    load_timeout_s: float = 5.0  # deadline for a prefetch from lower tiers before recomputing
    # Host RAM for the KV of preempted requests, so they resume instead of recomputing (taken per
    # swapped request, given back on resume); 0 = off: always recompute.
    swap_space_gb: float = 1.0
    # KV events (ZMQ PUB) for a router's global KV index, e.g. tcp://127.0.0.1:5557 (:* = a free port);
    # None = off. Snapshots are served on kv_events_snapshot_endpoint (None: same host, a free port).
    kv_events_endpoint: str | None = None
    kv_events_snapshot_endpoint: str | None = None  # where snapshot requests are answered
    # pdserve: its own events (above). vllm: vLLM's wire format (topic kv@<host>:<port>@<model>, msgspec-style
    # tagged structs, a replay socket on kv_events_snapshot_endpoint) for consumers written for vLLM; vllm-array:
    # the same with events laid out as arrays, as earlier vLLM releases wrote them. See docs/kv-cache.md.
    kv_events_format: str = "pdserve"
    # The dtype the KV cache holds: auto, float32 or bfloat16. bfloat16 halves the cache's bytes, and
    # so what a decode step reads at long contexts and many streams, and doubles the tokens a pool
    # holds; keys and values are rounded to it as they are written and every query attends to the
    # rounded values. auto: bfloat16 for float32 activations over int4 or int8 weights (the default
    # model's), else model.dtype (float32 weights keep HF's float32 results); in a PD deployment the
    # decode role's, so that both ends of a transfer hold one dtype (docs/kv-cache.md). MLA and MoE
    # models keep model.dtype (expert-parallel pools hold no other).
    kv_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # cap on running requests (the decode batch cap)
    max_num_batched_tokens: int = 512  # per-step token budget; prompts longer than it are chunked
    enable_chunked_prefill: bool = True  # chunk prompts longer than the step budget
    watermark_blocks: int = 1  # free blocks kept back at admission so decodes rarely preempt
    # Speculative decoding (engine/spec_decode.py): "ngram" drafts up to num_speculative_tokens from
    # the request's own earlier text (the last prompt_lookup_max..min tokens looked up), "draft" from
    # speculative_model (engine/draft_model.py), verified in the same step; greedy output is
    # unchanged, sampled output keeps its distribution. "none": off.
    speculative_method: str = "none"
    num_speculative_tokens: int = 4
    # The draft model (a name as model.name takes it, sharing the served model's tokenizer), and the
    # quantization of its weights (auto: as stored; the served model itself, int4, drafts for float32).
    speculative_model: str | None = None
    speculative_quantization: str = "auto"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Verify only the drafts expected to pay for their rows, from this machine's measured step cost by
    # row count (calibrated at start, cached) and each request's acceptance (engine/spec_policy.py).
    # False: verify every proposed draft.
    speculative_adaptive: bool = True


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The address the router and peers use to reach this worker when `host` binds every interface
    # (None: PDSERVE_ADVERTISE_HOST, else this machine's address; see utils/net.py).
    advertise_host: str | None = None
    # The model ids clients may send (a list, or one string with commas); the first names the model
    # in responses. None: the --model value as written.
    served_model_name: str | list[str] | None = None
    # Chat answers: the text between <think> and </think> comes back as `reasoning_content`
    # (deepseek_r1, qwen3; docs/api.md). None: off, the whole text is `content`.
    reasoning_parser: str | None = None
    # Chat answers with tools: how the model writes a tool call (hermes, llama3_json, mistral,
    # qwen3_coder, deepseek_v3, ...; docs/api.md). None: read from the chat template, hermes when the
    # template renders no tools (the server then describes them in a system message).
    tool_call_parser: str | None = None
    threads: int | None = None  # torch compute threads; None leaves torch's default
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long running requests may take to finish
    max_body_bytes: int = 4 * 1024 * 1024
    # Shared secret between router and workers: a worker with one rejects every route but /health
    # without it. Also read from PDSERVE_INTERNAL_TOKEN.
    internal_token: str | None = None
    # Keys an outside router (a gateway's endpoint picker) presents as `Authorization: Bearer` to call
    # this worker's OpenAI API (/v1/*, /tokenize, /detokenize) directly; never the internal routes, the
    # KV plane or role switches (docs/security.md). Also PDSERVE_WORKER_API_KEYS (comma-separated).
    # Needs the internal token: without one every route is open anyway.
    worker_api_keys: list[str] = field(default_factory=list)
    router_url: str | None = None  # a worker registers itself there and sends heartbeats
    # OpenTelemetry collector (OTLP/HTTP, e.g. http://collector:4318) for request traces; unset: off
    # (also OTEL_EXPORTER_OTLP_ENDPOINT). See common/tracing.py.
    otlp_endpoint: str | None = None
    # A worker's /metrics also exports vLLM's metric names (vllm:num_requests_waiting, ... with a model_name
    # label; docs/api.md) for dashboards, autoscalers and endpoint pickers built on them; false: pdserve_* only.
    vllm_metrics: bool = True


@dataclass(frozen=True)
class DisaggConfig:
    # The decode worker prefills itself when the uncached part of the prompt is shorter than this.
    local_prefill_max_tokens: int = 64
    prefill_endpoints: list[str] = field(default_factory=list)  # bootstrap endpoints of prefill workers
    bootstrap_timeout_s: float = 5.0  # a prefill worker must accept a job within this
    queue_timeout_s: float = 60.0  # an accepted job must start transferring within this
    transfer_timeout_s: float = 10.0  # longest silence allowed while transferring
    quarantine_timeout_s: float = 30.0  # blocks of a failed shm transfer wait this long for a cancel ack
    peer_retry_s: float = 10.0  # a prefill worker that failed is skipped this long
    # A prompt with at least this many uncached tokens is split into chunks prefilled by several prefill
    # workers in a layer-wise pipeline (disagg/pipeline.py; needs the decode pool in shared memory, one
    # host); 0: off. A chunk is computed in one step: give prefill workers a max_num_batched_tokens to match.
    parallel_prefill_min_tokens: int = 0
    # Where the prompt is cut (disagg/split.py): attention's cost per (query, key) pair relative to
    # its FLOP share; 0 cuts at equal token counts.
    parallel_prefill_attention_weight: float = 1.0


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "auto"  # auto (shm on one host, else tcp) | shm | tcp | mooncake | nixl
    # mooncake, nixl: optional extras (pip install 'pdserve[mooncake]' / 'pdserve[nixl]'), one-sided
    # writes through Mooncake's transfer engine or NIXL; set on the prefill and decode workers alike.
    bandwidth_limit: str | float | None = None  # bytes/s, or "50%" of the memcpy speed measured at start
    layerwise: bool = True  # write each layer as soon as it is computed (False: after the forward)


@dataclass(frozen=True)
class RoleConfig:
    # Workers of this role; None: from deployment.pd_ratio, else 1. Each instance with expert_parallel
    # N is N processes (devices).
    instances: int | None = None
    threads: int | None = None  # torch threads per worker (None: server.threads, else ROLE_THREADS)
    cpu_affinity: list[int] | None = None  # cores the role's workers are pinned to (None: no pinning)
    # Per-role model and engine settings (examples/wide-ep.yaml: prefill EP 8, decode EP 64); None: the
    # global key of the same name (ROLE_SETTINGS below names it) applies.
    expert_parallel: int | None = None
    quantization: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # this role's KV budget (replaces cache.device_memory_gb/device_blocks)
    device_memory_gb: float | None = None
    device_blocks: int | None = None


@dataclass(frozen=True)
class DeploymentConfig:
    mode: str = "pd"  # pd (router + prefill + decode workers) | mixed (one process)
    # "P:D": prefill to decode devices (instances x expert_parallel), e.g. "1:2"; sets the instance counts
    # not given; instances that are given win (a ratio they do not match is a warning, see deployment_plan.py).
    pd_ratio: str | None = None
    prefill: RoleConfig = field(default_factory=RoleConfig)
    decode: RoleConfig = field(default_factory=RoleConfig)
    # Workers that `pdserve serve` starts on one machine lend their threads to each other's steps while
    # they have no work (docs/deploying.md); not where a role has cpu_affinity (shares_idle_cores).
    share_idle_cores: bool = True


@dataclass(frozen=True)
class LoadBalancerConfig:
    # round_robin | least_load | power_of_two | cache_aware | cost (see docs/routing.md)
    prefill: str = "cost"  # how the router picks a prefill worker
    decode: str = "cost"  # how the router picks a decode worker


@dataclass(frozen=True)
class RouterConfig:
    # static workers: [{url: ..., role: prefill|decode|mixed}]; or other engines' workers, which the router
    # fronts (docs/router.md): [{url: ..., role: vllm|sglang, kv_events_endpoint: tcp://..., kv_events_replay_endpoint:
    # tcp://...}] (pdserve and other engines' workers are not mixed)
    workers: list[dict] = field(default_factory=list)
    # The key the router presents (Authorization: Bearer) to vLLM/SGLang workers it fronts (their --api-key,
    # or a pdserve worker's server.worker_api_keys); also PDSERVE_UPSTREAM_API_KEY. None: none sent.
    upstream_api_key: str | None = None
    api_keys: list[str] = field(default_factory=list)  # also PDSERVE_API_KEYS (comma-separated); none: open
    # /admin/* keys (also PDSERVE_ADMIN_KEYS); set: only these
    admin_keys: list[str] = field(default_factory=list)
    insecure_admin: bool = False  # start off loopback without an admin key (docs/security.md)
    ip_allowlist: list[str] = field(default_factory=list)  # CIDRs; empty: everyone
    requests_per_minute: int | None = None  # per API key (per client IP without keys)
    tokens_per_minute: int | None = None  # prompt + completion tokens, per API key
    # Redis URL where router replicas keep those buckets together (unset: each replica its own).
    shared_limits: str | None = None
    max_prompt_tokens: int | None = None  # longer prompts get a 400 (the context limit applies anyway)
    tls_cert: str | None = None
    tls_key: str | None = None
    max_concurrent: int = 256  # requests in flight to workers; more wait in the admission queue
    max_queue: int = 512  # beyond this many waiting: 503 with Retry-After
    queue_timeout_s: float = 30.0  # a request waiting longer gets a 503 with Retry-After
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # longest silence from a worker mid-request
    max_retries: int = 2  # before any token: connect errors, 5xx, 429
    retry_backoff_s: float = 0.1  # doubled each retry, with jitter
    breaker_failures: int = 5  # consecutive failures that open a worker's circuit breaker
    breaker_cooldown_s: float = 5.0  # open this long, then one probe request (half-open)
    migration: bool = True  # a decode worker dying mid-stream: continue on another one
    max_migrations: int = 2  # per request
    hold_prefill: bool = False  # hold prompts until a prefill worker has room (router/prefill_hold.py)
    encoder_workers: int = 1  # processes that apply chat templates and tokenize
    health_period_s: float = 1.0
    heartbeat_timeout_s: float = 5.0  # a self-registered worker silent this long is unhealthy


@dataclass(frozen=True)
class VisionConfig:
    """Images in chat requests (OpenAI `image_url` parts), for vision-language models."""

    max_images: int = 4  # image parts per request; 0 refuses every image
    # one image file (after base64 decoding; server.max_body_bytes bounds the body)
    max_image_bytes: int = 3 << 20
    max_image_pixels: int = 4096 * 4096  # width x height of one decoded image
    allow_remote_urls: bool = False  # fetch http(s) image URLs; off: only data: URLs
    remote_timeout_s: float = 10.0  # deadline of one remote image fetch, redirects and all
    # Networks remote image URLs may reach although not public (an image store of your own, e.g.
    # 10.1.0.0/16); any other private, loopback or link-local address is refused.
    remote_url_allow_networks: list[str] = field(default_factory=list)
    # Encoder workers running the vision tower and projector: endpoints of `pdserve worker --role
    # encoder` processes (tcp://host:port), or this many local ones; neither: in the engine process.
    encoder_endpoints: list[str] = field(default_factory=list)
    encoder_processes: int = 0
    encode_timeout_s: float = 60.0  # deadline of one image's embeddings from an encoder worker


@dataclass(frozen=True)
class ControllerConfig:
    # The autoscaler in the router (control/controller.py), off by default: every interval_s it reads the fleet's
    # figures against the SLOs and switches a role, or starts or stops a worker (docs/control-plane.md).
    enabled: bool = False
    interval_s: float = 5.0
    slo_ttft_ms: float = 2000.0  # time to first token the deployment promises (p90 over an interval)
    slo_tpot_ms: float = 200.0  # time per output token (read as the mean inter-token gap over an interval)
    kv_usage_high: float = 0.9  # decode KV usage counted as pressure as much as a TPOT at the SLO
    high: float = 1.0  # a pool is short of workers above this share of its SLO ...
    low: float = 0.5  # ... and has one to spare below it
    # readings of the last sustain_intervals + 1 a condition must hold to act (hysteresis)
    sustain_intervals: int = 3
    cooldown_s: float = 30.0  # no action this long after the last one
    # at max_workers, a worker moves to a hot pool from one that is not cold when the worse of the two
    # pressures is predicted this x lower after the move (each pool's load spread over its workers)
    switch_gain: float = 1.25
    min_workers: int = 2
    max_workers: int = 4
    drain_timeout_s: float = 30.0  # a draining worker's requests may finish this long, then move elsewhere
    # after a switch to decode, workers over the pool's mean hand the excess streams on
    rebalance: bool = True
    # local: start and stop worker processes; kubernetes: scale Deployments; hosts: ask the host agents
    # (`pdserve agent`) in `agents` to start and stop workers on their hosts
    backend: str = "local"
    agents: list[str] = field(default_factory=list)  # hosts: each worker host's agent URL
    namespace: str = "default"  # kubernetes: where the pools' Deployments live
    prefill_deployment: str = "pdserve-prefill"
    decode_deployment: str = "pdserve-decode"
    # Redis URL of the lease router replicas hold to elect the one whose controller acts (unset:
    # router.shared_limits' Redis when set, else every replica's controller acts: one router)
    leader_lease: str | None = None
    lease_s: float = 15.0  # a holder that stops renewing loses the lease after this long


@dataclass(frozen=True)
class RolloutConfig:
    # `pdserve rollout --config NEW` reads these from NEW (control/rollout.py; docs/control-plane.md).
    canary_weight: float = 0.1  # share of new requests sent to the new version first; widens per worker
    window_s: float = 30.0  # after each new worker: its version's figures over this long
    slo_ttft_ms: float | None = None  # TTFT p90 the new version must keep (None: controller.slo_ttft_ms)
    slo_tpot_ms: float | None = None  # TPOT p90 (None: controller.slo_tpot_ms)
    max_error_rate: float = 0.01  # share of the new version's requests that may fail
    health_timeout_s: float = 300.0  # a new worker must be healthy within this


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "mixed"  # mixed | prefill | decode
    kv_port: int | None = None  # prefill: bootstrap port; decode: KV/control port (None: free port)
    worker_id: str | None = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    load_balancer: LoadBalancerConfig = field(default_factory=LoadBalancerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Torch threads of a prefill or decode worker when neither its role nor server.threads sets them:
# the workers of a one-machine deployment share its cores.
ROLE_THREADS = 1

# deployment.<role>.<key> -> the global key it replaces for the workers of that role.
ROLE_SETTINGS = {
    "expert_parallel": "model.expert_parallel",
    "quantization": "model.quantization",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "device_memory_gb": "cache.device_memory_gb",
    "device_blocks": "cache.device_blocks",
    "threads": "server.threads",
}


def shares_idle_cores(cfg: Config) -> bool:
    """Whether the workers one launcher starts lend each other idle threads (utils/core_share.py):
    deployment.share_idle_cores, unless a role is pinned to cores of its own."""
    d = cfg.deployment
    return d.share_idle_cores and not (d.prefill.cpu_affinity or d.decode.cpu_affinity)


def served_names(cfg: Config) -> list[str]:
    """The model ids this deployment answers to, the one its responses name first."""
    v = cfg.server.served_model_name
    names = [n.strip() for n in (v.split(",") if isinstance(v, str) else v or [])]
    return [n for n in names if n] or [cfg.model.name]


def apply_role(cfg: Config, role: str, keep: set[str] | frozenset[str] = frozenset()) -> Config:
    """A copy of cfg with deployment.<role>'s settings (ROLE_SETTINGS) in place of the global keys they
    name, except those in `keep`. Roles without a deployment entry (mixed) are left alone."""
    rc = getattr(cfg.deployment, role, None)
    if not isinstance(rc, RoleConfig):
        return cfg
    changes: dict[str, Any] = {}
    for key, target in ROLE_SETTINGS.items():
        section, leaf = target.split(".")
        value = getattr(rc, key, None)
        if value is not None and target not in keep and hasattr(getattr(cfg, section), leaf):
            changes[target] = value
    if rc.device_memory_gb is not None and rc.device_blocks is None and "cache.device_blocks" not in keep:
        changes["cache.device_blocks"] = None  # the role's budget replaces the global one, in blocks too
    if changes.get("server.threads", cfg.server.threads) is None:
        changes["server.threads"] = ROLE_THREADS
    return derive(cfg, changes)


def derive(cfg: Config, changes: dict[str, Any]) -> Config:
    """A copy of cfg with these dotted keys set ("server.port": 8001); the sections not named are shared
    (they are frozen). Values are taken as given: load_config is where input is checked."""

    def put(obj: Any, parts: list[str], value: Any) -> Any:
        if len(parts) == 1:
            return dataclasses.replace(obj, **{parts[0]: value})
        return dataclasses.replace(obj, **{parts[0]: put(getattr(obj, parts[0]), parts[1:], value)})

    for dotted, value in changes.items():
        cfg = put(cfg, dotted.split("."), value)
    return cfg


def for_role(cfg: Config, role: str) -> Config:
    """A copy of cfg as a worker of `role` sees it."""
    return apply_role(cfg, role)


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, role: str | None = None
) -> Config:
    """Defaults, then the YAML file, then overrides given as dotted keys ("cache.block_size": 32; None
    values are skipped), every value checked (config_rules.py; ConfigError names each bad key). With
    `role`, deployment.<role>'s settings then replace the global keys they name, except the keys
    `overrides` set: a worker's own flags win."""

    cfg = Config()
    problems: list[tuple[str, str]] = []
    written_as: dict[str, str] = {}
    if path is not None:
        leaves: list = []
        leaves_of(cfg, read_yaml(path), "", leaves, problems)
        set_leaves(cfg, leaves, problems, written_as)
    nested = nest_dotted(overrides or {})
    leaves = []
    leaves_of(cfg, nested, "", leaves, problems)
    given = set_leaves(cfg, leaves, problems, written_as)
    if problems:
        raise ConfigError(problems)
    try:
        check(cfg)
    except ConfigError as e:  # name the key as the user wrote it, once for all the keys it sets
        renamed = [(written_as.get(key, key), msg) for key, msg in e.problems]
        raise ConfigError(list(dict.fromkeys(renamed))) from None
    if role is not None:
        cfg = apply_role(cfg, role, given)
    return cfg
