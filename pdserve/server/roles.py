"""A worker's role: which engine it builds and which KV connector plugs into its loop."""
from __future__ import annotations

import logging

from pdserve.cache.kv_cache import new_shm_path
from pdserve.config import Config
from pdserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)
ROLES = ("mixed", "prefill", "decode")


def kv_bind_endpoint(config: Config) -> str:
    port = config.worker.kv_port
    return f"tcp://{config.server.host}:{port if port else '*'}"


def build_engine(config: Config) -> LLMEngine:
    """The engine of this worker's role, its connector attached; the connector's endpoint is
    `engine.connector.endpoint` for prefill and decode workers."""
    role = config.worker.role
    if role not in ROLES:
        raise ValueError(f"worker.role must be one of {ROLES}, not {role!r}")
    if role == "decode":
        from pdserve.disagg.receiver import DecodeConnector
        # Prefill workers on this host write straight into a pool in shared memory.
        shm = str(new_shm_path()) if config.transfer.backend in ("auto", "shm") else None
        engine = LLMEngine(config, shm_path=shm)
        engine.connector = DecodeConnector(config, engine.kv_cache, shm, kv_bind_endpoint(config))
    elif role == "prefill":
        from pdserve.disagg.sender import PrefillConnector
        engine = LLMEngine(config)
        engine.connector = PrefillConnector(config, engine.kv_cache, kv_bind_endpoint(config))
    else:
        engine = LLMEngine(config)
    endpoint = getattr(engine.connector, "endpoint", None)
    if endpoint:
        log.info("%s worker: KV endpoint %s", role, endpoint)
    return engine
