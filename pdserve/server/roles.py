"""A worker's role: which engine it builds and which KV connector plugs into its loop."""

from __future__ import annotations

import ipaddress
import logging

from pdserve.cache.kv_cache import new_shm_path
from pdserve.config import Config, served_names
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import LoadedModel
from pdserve.server.internal_api import internal_token
from pdserve.utils.net import advertise_host

log = logging.getLogger(__name__)
ROLES = ("mixed", "prefill", "decode")


def kv_bind_endpoint(config: Config) -> str:
    port = config.worker.kv_port
    return f"tcp://{config.server.host}:{port if port else '*'}"


def public_host(config: Config) -> str:
    """The host this worker's URL and endpoints name for other processes."""
    return advertise_host(config.server.host, config.server.advertise_host)


def worker_name(config: Config) -> str:
    """This worker's id in KV events and at the router."""
    return config.worker.worker_id or f"{config.worker.role}@{public_host(config)}:{config.server.port}"


def kv_event_publisher(config: Config):
    """The worker's KV event publisher, or None when cache.kv_events_endpoint is unset."""
    cc = config.cache
    if not cc.kv_events_endpoint:
        return None
    from pdserve.cache.kv_events import KVEventPublisher

    snapshot = cc.kv_events_snapshot_endpoint
    if snapshot is None:
        ep = cc.kv_events_endpoint
        snapshot = ep.rsplit(":", 1)[0] + ":*" if ep.startswith("tcp://") else ep + "-snapshot"
    worker_id = worker_name(config)
    if cc.kv_events_format != "pdserve":
        return _vllm_event_publisher(config, snapshot, worker_id)
    pub = KVEventPublisher(
        cc.kv_events_endpoint,
        worker_id,
        snapshot,
        advertise_host=public_host(config),
        token=internal_token(config.server.internal_token),
    )
    log.info("KV events on %s, snapshots on %s", pub.endpoint, pub.snapshot_endpoint)
    if not internal_token(config.server.internal_token) and not _loopback_endpoint(cc.kv_events_endpoint):
        log.warning(
            "KV events on %s without an internal token: anyone who reaches it reads this worker's block "
            "hashes and can probe its cache; set PDSERVE_INTERNAL_TOKEN or bind 127.0.0.1",
            cc.kv_events_endpoint,
        )
    return pub


def _vllm_event_publisher(config: Config, replay: str, worker_id: str):
    """KV events in vLLM's format (cache/kv_events_vllm.py), replayed on `replay`."""
    from pdserve.cache.kv_events_vllm import VLLMEventPublisher, topic

    cc = config.cache
    host = public_host(config)
    pub = VLLMEventPublisher(
        cc.kv_events_endpoint,
        worker_id,
        replay,
        topic=topic(f"{host}:{config.server.port}", served_names(config)[0]),
        block_size=cc.block_size,
        layout=cc.kv_events_format,
        advertise_host=host,
    )
    log.info(
        "KV events (%s format) on %s, replay on %s", cc.kv_events_format, pub.endpoint, pub.replay_endpoint
    )
    if not _loopback_endpoint(cc.kv_events_endpoint):
        log.warning(
            "vLLM-format KV events on %s are not encrypted (vLLM's consumers speak plain ZMQ): whoever reaches "
            "it reads this worker's block hashes and token ids; bind it where only your routers reach",
            cc.kv_events_endpoint,
        )
    return pub


def _loopback_endpoint(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return True  # ipc:// and inproc:// stay on this machine
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def kv_pool_in_shm(config: Config, role: str) -> bool:
    """Whether this worker's KV pool lives in shared memory: a decode worker's does, so that prefill
    workers on this host write into it; a prefill worker's too on CPU, so that it can switch to
    decode in place (server/role_switch.py) with the same pool."""
    if config.transfer.backend not in ("auto", "shm"):
        return False
    return role == "decode" or (role == "prefill" and config.model.device == "cpu")


def build_connector(config: Config, role: str, engine: LLMEngine) -> None:
    """Plug `role`'s KV connector into `engine` (a mixed worker keeps the base one, which does nothing)."""
    from pdserve.engine.kv_connector import KVConnector

    if role == "decode":
        from pdserve.disagg.receiver import DecodeConnector
        from pdserve.disagg.split import attention_weight

        engine.connector = DecodeConnector(
            config,
            engine.kv_cache,
            engine.kv_shm_path,
            kv_bind_endpoint(config),
            public_host(config),
            internal_token(config.server.internal_token),
            engine.max_model_len,
            attention_weight(engine.arch, config.disagg.parallel_prefill_attention_weight),
            engine.arch.kv_layout_name,
        )
    elif role == "prefill":
        from pdserve.disagg.sender import PrefillConnector

        engine.connector = PrefillConnector(
            config,
            engine.kv_cache,
            kv_bind_endpoint(config),
            public_host(config),
            internal_token(config.server.internal_token),
            engine.arch.kv_layout_name,
        )
    else:
        engine.connector = KVConnector()
    endpoint = getattr(engine.connector, "endpoint", None)
    if endpoint:
        log.info("%s worker: KV endpoint %s", role, endpoint)


def build_engine(config: Config, loaded: LoadedModel | None = None) -> LLMEngine:
    """The engine of this worker's role, its connector attached; the connector's endpoint is
    `engine.connector.endpoint` for prefill and decode workers."""
    role = config.worker.role
    if role not in ROLES:
        raise ValueError(f"worker.role must be one of {ROLES}, not {role!r}")
    shm = str(new_shm_path()) if kv_pool_in_shm(config, role) else None
    engine = LLMEngine(config, loaded, shm_path=shm, kv_events=kv_event_publisher(config))
    build_connector(config, role, engine)
    return engine
