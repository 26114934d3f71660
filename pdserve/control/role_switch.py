"""The router's side of a role switch and of a drain: stop routing to the worker, let its requests
finish (or have the worker hand them back to be continued elsewhere), then tell it to switch.

Used by `POST /admin/workers/{id}/role` and by the controller (control/controller.py), which also
evens out the decode pool after a worker joins it (`even_out`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import httpx

from pdserve.protocol.control import RoleChanged, ShedRequest

if TYPE_CHECKING:  # the router hands these in; at run time the control plane imports no router module
    from pdserve.router.registry import Registry, Worker

log = logging.getLogger(__name__)
_POLL_S = 0.02


class SwitchRefused(Exception):
    """The switch cannot be done (`status` is the HTTP status the admin API answers)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def serving_decode(registry: Registry, but: Worker | None = None) -> list[Worker]:
    """Decode-capable workers that take new work, `but` left out."""
    return [w for w in registry.pool("decode") if w is not but and w.healthy and not w.draining]


async def drain(w: Worker, deadline: float) -> bool:
    """Wait until the router has nothing in flight at `w` (True) or the deadline passes (False).
    The caller has set `w.draining`, so nothing new is sent there."""
    while w.in_flight > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


async def switch_role(
    registry: Registry, client: httpx.AsyncClient, w: Worker, role: str, drain_timeout_s: float
) -> RoleChanged:
    """Drain `w` here, have it switch to `role` in place, and route to it in its new role."""
    if w.role == role:
        return RoleChanged(role=role, kv_endpoint=w.kv_endpoint)
    if w.role not in ("prefill", "decode"):
        raise SwitchRefused(
            409,
            f"worker {w.worker_id!r} is {w.role}; only prefill and decode workers switch",
            "not_switchable",
        )
    if w.draining:
        raise SwitchRefused(409, f"worker {w.worker_id!r} is already draining", "worker_draining")
    if w.role == "decode" and not serving_decode(registry, but=w):
        raise SwitchRefused(
            409, f"worker {w.worker_id!r} is the last decode worker taking requests", "last_decode"
        )
    t0 = time.monotonic()
    w.draining = True
    try:
        drained = await drain(w, t0 + drain_timeout_s)
        left = max(0.0, t0 + drain_timeout_s - time.monotonic())
        log.info(
            "worker %s: switching %s -> %s (%s)",
            w.worker_id,
            w.role,
            role,
            "drained" if drained else f"{w.in_flight} in flight are moved",
        )
        try:
            r = await client.post(
                w.url + "/internal/role",
                json={"role": role, "drain_timeout_s": left},
                headers=registry.headers,
                timeout=left + 120.0,
            )
        except httpx.HTTPError as e:
            raise SwitchRefused(
                502, f"worker {w.worker_id!r} did not answer the switch: {e}", "worker_failed"
            ) from e
        if r.status_code != 200:
            try:
                err = r.json().get("error") or {}
            except ValueError:
                err = {}
            raise SwitchRefused(
                502 if r.status_code >= 500 else r.status_code,
                f"worker {w.worker_id!r} refused the switch: {err.get('message', r.text[:200])}",
                err.get("code") or "worker_failed",
            )
        changed = RoleChanged.model_validate(r.json())
        w.role, w.kv_endpoint = changed.role, changed.kv_endpoint
        await registry.check(client, w, time.monotonic())
        log.info(
            "worker %s is %s now (%.2fs, %d requests moved)",
            w.worker_id,
            w.role,
            time.monotonic() - t0,
            changed.moved,
        )
        return changed
    finally:
        w.draining = False


async def _ask(
    registry: Registry,
    client: httpx.AsyncClient,
    w: Worker,
    path: str,
    body: dict,
    timeout: float,
    refused: str,
) -> RoleChanged:
    """POST `body` to the worker's internal `path`; its RoleChanged answer, or a 502 SwitchRefused
    (`refused` says what a non-200 answer means)."""
    try:
        r = await client.post(w.url + path, json=body, headers=registry.headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise SwitchRefused(502, f"worker {w.worker_id!r} did not answer: {e}", "worker_failed") from e
    if r.status_code != 200:
        raise SwitchRefused(502, f"worker {w.worker_id!r} {refused}: {r.text[:200]}", "worker_failed")
    return RoleChanged.model_validate(r.json())


async def empty_worker(
    registry: Registry, client: httpx.AsyncClient, w: Worker, drain_timeout_s: float
) -> int:
    """Before a scale-down stops `w`: no new work, its requests finish until the deadline, the rest
    move to other workers. `w` stays draining (it is about to go). Returns how many moved."""
    if w.role in ("decode", "mixed") and not serving_decode(registry, but=w):
        raise SwitchRefused(
            409, f"worker {w.worker_id!r} is the last decode worker taking requests", "last_decode"
        )
    t0 = time.monotonic()
    w.draining = True
    try:
        await drain(w, t0 + drain_timeout_s)
        left = max(0.0, t0 + drain_timeout_s - time.monotonic())
        moved = (
            await _ask(
                registry,
                client,
                w,
                "/internal/leave",
                {"drain_timeout_s": left},
                left + 120.0,
                "could not empty itself",
            )
        ).moved
    except BaseException:
        await back_into_service(registry, client, w)
        raise
    await drain(w, time.monotonic() + 10.0)  # the moved streams' last lines
    log.info("worker %s emptied in %.2fs (%d requests moved)", w.worker_id, time.monotonic() - t0, moved)
    return moved


async def back_into_service(registry: Registry, client: httpx.AsyncClient, w: Worker) -> bool:
    """Undo empty_worker when the worker is not stopped after all: it takes new work again
    (`POST /internal/rejoin`), and only then does the router send it some. A worker that cannot be told
    stays out of service (draining, as /admin/workers shows): sent requests, it would only hand them back."""
    try:
        await _ask(registry, client, w, "/internal/rejoin", {}, 30.0, "could not rejoin")
    except SwitchRefused as e:
        log.warning("worker %s stays out of service: %s", w.worker_id, e)
        return False
    w.draining = False
    log.info("worker %s is back in service", w.worker_id)
    return True


def excess_streams(loads: dict[str, int]) -> dict[str, int]:
    """Streams each worker should hand on for the pool to hold about the same number everywhere:
    what it holds over the pool's mean, rounded down, where that is at least 2 (one stream more or
    less is not worth a move)."""
    if len(loads) < 2:
        return {}
    mean = sum(loads.values()) / len(loads)
    return {wid: int(n - mean) for wid, n in loads.items() if n - mean >= 2}


async def even_out(registry: Registry, client: httpx.AsyncClient) -> dict[str, int]:
    """Workers of the decode pool holding more streams than its mean (the router's count of what
    is in flight at each) give the excess up; their router continues each on the least loaded
    worker (what was generated goes along; greedy outputs are unchanged). Returns the streams
    each worker gave up. A worker that joined the pool by a switch starts with none, while the
    streams started before stay where they are until they finish."""
    pool = {w.worker_id: w for w in serving_decode(registry)}
    moved = {}
    for wid, count in excess_streams({wid: w.in_flight for wid, w in pool.items()}).items():
        w = pool[wid]
        moved[wid] = (
            await _ask(
                registry,
                client,
                w,
                "/internal/shed",
                ShedRequest(count=count).model_dump(),
                30.0,
                "did not give streams up",
            )
        ).moved
        log.info(
            "worker %s gave up %d of its %d streams to even out the decode pool", wid, moved[wid], w.in_flight
        )
    return moved
