"""A worker's self-registration: it registers with every router replica and sends heartbeats.

`server.router_url` (`--router-url`) is one URL or several, comma-separated. An http URL whose
host name resolves to several addresses (a Kubernetes headless Service over N router pods) is
registered at each address, resolved again every period, so a router that starts later learns
the worker within one period and a router that goes away is dropped. https URLs are used as
given (a certificate names the host, not its addresses).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from pdserve import __version__
from pdserve.config import Config
from pdserve.protocol import INTERNAL_TOKEN_HEADER, WorkerRegistration
from pdserve.server.internal_api import internal_token
from pdserve.server.roles import public_host, worker_name
from pdserve.utils.net import with_host

log = logging.getLogger(__name__)


def router_targets(router_urls: str) -> list[str]:
    """The base URLs to register at: each http URL once per address of its host (IPv4 addresses
    when there are any: a name with both families is one machine), https URLs as they are."""
    out: list[str] = []
    for url in (u.strip().rstrip("/") for u in router_urls.split(",")):
        if not url:
            continue
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            out.append(url)
            continue
        port = parts.port or 80
        try:
            infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("cannot resolve router %s: %s", url, e)
            continue
        v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
        addrs = v4 or [i[4][0] for i in infos if i[0] == socket.AF_INET6]
        for addr in dict.fromkeys(addrs):
            out.append(with_host(f"http://{parts.hostname}:{port}", addr) + parts.path)
    return list(dict.fromkeys(out))


async def register_with_routers(
    config: Config,
    model_name: str,
    role: Callable[[], str] | None = None,
    changed: asyncio.Event | None = None,
    digest: str | None = None,
) -> None:
    """Register at every router, then send heartbeats; re-register wherever a router forgot us, and
    everywhere when `changed` is set (the worker switched role: `role()` says which it has now)."""
    import httpx

    s = config.server
    reg = WorkerRegistration(
        worker_id=worker_name(config),
        role=config.worker.role,
        model=model_name,
        url=with_host(f"http://{s.host}:{s.port}", public_host(config)),
        pid=os.getpid(),
        capacity=config.scheduler.max_num_seqs,
        pdserve_version=__version__,
        config_digest=digest,
    )
    token = internal_token(s.internal_token)
    headers = {INTERNAL_TOKEN_HEADER: token} if token else {}
    registered: dict[str, bool] = {}
    refused: dict[str, bool] = {}

    epoch = [0]  # bumped when the registration changes: a beat begun before must not mark it sent

    async def beat(client: httpx.AsyncClient, base: str) -> None:
        began = epoch[0]
        try:
            if not registered.get(base):
                r = await client.post(base + "/admin/workers/register", json=reg.model_dump())
            else:
                r = await client.post(f"{base}/admin/workers/{reg.worker_id}/heartbeat")
            if r.status_code in (401, 403) and not refused.get(base):
                # Not transient: the router wants the internal token (or this one); said once per refusal.
                log.error(
                    "router %s refuses this worker's registration (%d: %s); give the worker the "
                    "router's internal token (PDSERVE_INTERNAL_TOKEN)",
                    base,
                    r.status_code,
                    r.text[:200],
                )
            refused[base] = r.status_code in (401, 403)
            if began == epoch[0]:
                registered[base] = r.status_code == 200
        except httpx.HTTPError as e:
            if registered.get(base, True):
                log.warning("router %s unreachable: %s", base, e)
            registered[base] = False

    inflight: dict[str, asyncio.Task] = {}
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
        try:
            while True:
                targets = await asyncio.to_thread(router_targets, s.router_url or "")
                for gone in set(registered) - set(targets):
                    del registered[gone]
                # Each router on its own: one that does not answer (a partition) must not hold back
                # the heartbeats of the others past their heartbeat timeout.
                for base in targets:
                    if base not in inflight or inflight[base].done():
                        inflight[base] = asyncio.create_task(beat(client, base))
                if changed is None:
                    await asyncio.sleep(config.router.health_period_s)
                    continue
                try:
                    await asyncio.wait_for(changed.wait(), config.router.health_period_s)
                except asyncio.TimeoutError:
                    continue
                changed.clear()
                reg = reg.model_copy(update={"role": role() if role is not None else reg.role})
                registered.clear()
                epoch[0] += 1
        finally:
            for task in inflight.values():
                task.cancel()
