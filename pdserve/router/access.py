"""Who may call what on the router (the trust model), decided per request from the path and the
credentials presented:

- open: `/health` and `/metrics`, for probes and Prometheus; no credentials.
- registration: `POST /admin/workers/register` and `.../{id}/heartbeat`: the internal token (what
  self-registering workers send) or an admin key; never a client key, which would let a tenant
  register a worker of its own and receive other tenants' prompts.
- admin: the rest of `/admin/*`: an admin key once any key or the internal token is configured.
  `/health` shows the workers' detail (URLs, pids, KV endpoints) only to those who may call it.
- client: everything else (the OpenAI API): a client or an admin key once client keys are configured.

With no key and no token at all everything is open: the laptop default. A router that listens on
more than loopback without an admin key refuses to start (admin_exposure) unless told otherwise
(router.insecure_admin), and an open one is loudly warned about (exposure_warnings).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from dataclasses import dataclass

from starlette.responses import Response

from pdserve.config import Config, ConfigError
from pdserve.server.errors import error_response

OPEN_PATHS = ("/health", "/metrics")
_HEARTBEAT = re.compile(r"/admin/workers/[^/]+/heartbeat")


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_id(digest: bytes, prefix: str = "key-") -> str:
    """What logs and metrics name a key by: never the key itself."""
    return prefix + digest.hex()[:8]


class KeyStore:
    def __init__(self, keys: list[str], env: str = "PDSERVE_API_KEYS", prefix: str = "key-") -> None:
        from_env = [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
        self.digests = [hash_key(k) for k in [*keys, *from_env]]
        self.prefix = prefix

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def identify(self, presented: str) -> str | None:
        """The key id of a valid key, else None. Every stored digest is compared, in constant time."""
        d = hash_key(presented)
        found = None
        for stored in self.digests:
            if hmac.compare_digest(d, stored):
                found = key_id(stored, self.prefix)
        return found


def bearer_key(authorization: str) -> str:
    """The key of an `Authorization: Bearer <key>` header ("" when there is none)."""
    return authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""


def path_kind(path: str) -> str:
    """open | registration | admin | client (the path as the router routes it: already decoded)."""
    if path in OPEN_PATHS:
        return "open"
    if path == "/admin/workers/register" or _HEARTBEAT.fullmatch(path):
        return "registration"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    return "client"


@dataclass
class Verdict:
    reject: Response | None = None
    key: str | None = None  # the key id, when a key was presented and accepted


class Access:
    def __init__(self, clients: KeyStore, admins: KeyStore, token: str | None) -> None:
        self.clients, self.admins = clients, admins
        self.token = token.encode() if token else None

    @property
    def keyed(self) -> bool:
        return self.clients.enabled or self.admins.enabled

    @property
    def admin_open(self) -> bool:
        """Whether the admin API takes calls without an admin key: only with no key and no token at
        all (a token alone must not leave it open: a worker started through it inherits the token)."""
        return not (self.keyed or self.token)

    def admin_allowed(self, bearer: str) -> bool:
        return self.admin_open or bool(bearer and self.admins.identify(bearer))

    def check(self, path: str, bearer: str, token: bytes) -> Verdict:
        """bearer: the presented API key ("" when none); token: the internal-token header (b"" when none)."""
        kind = path_kind(path)
        if kind == "open":
            return Verdict()
        admin = self.admins.identify(bearer) if bearer else None
        client = self.clients.identify(bearer) if bearer and admin is None else None
        if kind == "registration":
            if admin or (self.token and token and hmac.compare_digest(token, self.token)):
                return Verdict(key=admin)
            if not self.keyed and not self.token:
                return Verdict()
            if client:
                return Verdict(
                    error_response(
                        403,
                        "client API keys cannot register workers; workers present the "
                        "internal token (PDSERVE_INTERNAL_TOKEN)",
                        code="internal_token_required",
                    ),
                    client,
                )
            return Verdict(
                error_response(
                    401,
                    "registering a worker needs the internal token "
                    "(x-pdserve-internal-token) or an admin key",
                    code="internal_token",
                )
            )
        if kind == "admin":
            if admin or self.admin_open:
                return Verdict(key=admin)
            if client:
                return Verdict(
                    error_response(
                        403,
                        "this API key is not an admin key (see router.admin_keys)",
                        code="admin_key_required",
                    ),
                    client,
                )
            return Verdict(
                error_response(
                    401, "an admin key is required (Authorization: Bearer ...)", code="invalid_api_key"
                )
            )
        if admin or client or not self.clients.enabled:
            return Verdict(key=admin or client)
        return Verdict(
            error_response(
                401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key"
            )
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name or an empty host: assume it is reachable from elsewhere


def check_admin_exposure(config: Config) -> None:
    """Raise ConfigError (naming router.admin_keys) when a router with this config must not start."""
    admins = KeyStore(config.router.admin_keys, "PDSERVE_ADMIN_KEYS").enabled
    problem = admin_exposure(config.server.host, admins, config.router.insecure_admin)
    if problem:
        raise ConfigError([("router.admin_keys", problem)])


def admin_exposure(host: str, admin_keys: bool, insecure_admin: bool) -> str | None:
    """Why a router must not start listening on `host` (None: it may): off loopback it needs an admin
    key, unless router.insecure_admin says the admin API may be open or unusable."""
    if admin_keys or insecure_admin or _loopback(host):
        return None
    return (
        f"the router listens on {host} with no admin key: set router.admin_keys (or PDSERVE_ADMIN_KEYS), "
        "bind 127.0.0.1, or accept an admin API that is open to anyone who can reach it when no key or token "
        "is set (router.insecure_admin: true, flag --insecure-admin)"
    )


def exposure_warnings(
    host: str, client_keys: bool, admin_keys: bool, token: bool, static_workers: bool = False
) -> list[str]:
    """What the router should warn about at start-up, given where it listens and what is configured
    (static_workers: it was given its workers, as by the launcher, so none needs to register)."""
    out = []
    if not (client_keys or admin_keys or token) and not _loopback(host):
        out.append(
            f"!!! the router listens on {host} with no API key, no admin key and no internal token: "
            "anyone who can reach it can use the API, drain and deregister workers, and register a "
            "worker of their own that receives other clients' prompts. Set PDSERVE_API_KEYS, "
            "PDSERVE_ADMIN_KEYS and PDSERVE_INTERNAL_TOKEN, or bind 127.0.0.1. !!!"
        )
    if (client_keys or admin_keys) and not token and not static_workers:
        out.append(
            "API keys are set but no internal token: workers cannot register themselves "
            "(--router-url); set PDSERVE_INTERNAL_TOKEN on the router and the workers"
        )
    return out
