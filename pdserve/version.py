"""A worker's version label: the pdserve version and a digest of the deployment config it runs.

The digest is a stable hash (sha256 of canonical JSON, 12 hex digits) of the config a worker was
started from, before its role's settings are applied, so that the prefill and decode workers of
one deployment config carry one version, and without what names the process rather than what it
runs (ports, hosts, its disk tier's directory, its role, the router it registers with, the router's and controller's own
sections, instance counts, secrets). Two workers with equal labels run the same code and settings;
`pdserve rollout` (control/rollout.py) replaces workers until every label is the new config's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve import __version__
from pdserve.config import Config

# Sections and keys that do not change what a worker computes or how it serves.
_SKIP_SECTIONS = ("router", "controller", "rollout", "worker")
_SKIP_KEYS = {
    "server": ("host", "port", "advertise_host", "router_url", "internal_token", "worker_api_keys"),
    # The disk tier's directory is where on the host, not what: each worker of a host has its own.
    "cache": ("kv_events_endpoint", "kv_events_snapshot_endpoint", "disk_cache_dir"),
    "disagg": ("prefill_endpoints",),
    "deployment": ("mode", "pd_ratio"),
}


def config_digest(cfg: Config) -> str:
    """12 hex digits naming what a worker started from `cfg` runs (see the module's docstring)."""
    d: dict[str, Any] = {k: v for k, v in cfg.to_dict().items() if k not in _SKIP_SECTIONS}
    for section, keys in _SKIP_KEYS.items():
        d[section] = {k: v for k, v in d[section].items() if k not in keys}
    for role in ("prefill", "decode"):
        d["deployment"][role] = {k: v for k, v in d["deployment"][role].items() if k != "instances"}
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def version_label(digest: str | None, pdserve_version: str | None = __version__) -> str | None:
    """ "<pdserve version>+<config digest>", the label the router routes canaries by (None: unknown)."""
    if digest is None:
        return None
    return f"{pdserve_version or 'unknown'}+{digest}"
