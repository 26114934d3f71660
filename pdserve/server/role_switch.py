"""A worker changes role in place: same process, same weights, same KV pool (and prefix cache).

`POST /internal/role` (the router's `POST /admin/workers/{id}/role` calls it after draining the
worker there): new work is refused (503, the router has stopped sending any), the requests still
here get `drain_timeout_s` to finish, the rest are given up as `RequestMoved` (the router continues
each stream on another worker; a prefill job's decode worker falls back to another peer). Then,
on the engine thread with nothing in flight, the old role's KV connector closes and the new one
opens on the same pool. The KV endpoint changes; the reply and /health carry the new one.

`POST /internal/leave` empties a worker the same way before it is stopped (a scale-down);
`POST /internal/rejoin` undoes it when the scale-down does not go through. Each transition is all or
nothing: a new connector that cannot be built gives the old role's back (still that role, a 503).
`POST /internal/shed` gives up only some of its generating streams, at once: the controller evens
out the decode pool after a worker joined it, and the streams continue on the new one.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI

from pdserve.config import Config
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.control import LeaveRequest, RoleChange, RoleChanged, ShedRequest
from pdserve.server.errors import APIError
from pdserve.server.roles import build_connector, kv_pool_in_shm

log = logging.getLogger(__name__)
SWITCHABLE = ("prefill", "decode")
_POLL_S = 0.02


class SwapFailed(RuntimeError):
    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class RoleSwitch:
    def __init__(self, config: Config, engine: AsyncEngine) -> None:
        self.config = config
        self.engine = engine
        self.role = config.worker.role
        self.switching = False
        self.leaving = False
        self.switches_total = 0
        self.moved_total = 0  # requests given up to be continued elsewhere
        self.changed = asyncio.Event()  # set after each switch: registration re-registers

    def refusal(self) -> str | None:
        if self.leaving:
            return "the worker is leaving the fleet"
        return f"the worker is switching from {self.role}" if self.switching else None

    def _idle(self) -> bool:
        return not self.engine.open_streams() and not self.engine.engine.has_unfinished()

    async def _wait_idle(self, deadline: float) -> bool:
        while not self._idle():
            if time.monotonic() >= deadline or self.engine.dead is not None:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    async def switch(self, role: str, drain_timeout_s: float) -> dict:
        if role not in SWITCHABLE:
            raise APIError(
                400,
                f"role {role!r} is not allowed; allowed: {', '.join(SWITCHABLE)}",
                "role",
                "invalid_value",
            )
        if self.role not in SWITCHABLE:
            raise APIError(409, f"a {self.role} worker does not switch roles", "role", "not_switchable")
        if (
            role == "decode"
            and self.engine.engine.kv_shm_path is None
            and kv_pool_in_shm(self.config, "decode")
        ):
            raise APIError(
                409,
                "this worker's KV pool is not in shared memory, so prefill workers could not write "
                "into it: start it with transfer.backend tcp to let it switch to decode",
                "role",
                "not_switchable",
            )
        if self.switching:
            raise APIError(409, "a role switch is already under way", "role", "switching")
        if self.engine.dead is not None:
            raise APIError(503, f"engine failed: {self.engine.dead}", code="engine_dead")
        if role == self.role:
            return self.describe(moved=0)
        self.switching = True
        t0 = time.monotonic()
        try:
            moved = await self._empty(drain_timeout_s, f"worker switching to {role}")
            deadline = time.monotonic() + self.config.disagg.quarantine_timeout_s + 5.0
            while not await self._swap_on_engine(role):
                # A peer's job came in over the KV plane meanwhile (HTTP work is refused): hand it back too.
                if time.monotonic() > deadline:
                    raise APIError(
                        503, "the worker kept receiving work over its KV plane", code="drain_timeout"
                    )
                moved += await self._empty(0.0, f"worker switching to {role}")
                await asyncio.sleep(_POLL_S)
            old, self.role = self.role, role
            self.switches_total += 1
            self.moved_total += moved
            log.info("switched from %s to %s in %.2fs (%d moved)", old, role, time.monotonic() - t0, moved)
            self.changed.set()
            return self.describe(moved=moved)
        finally:
            self.switching = False

    async def _empty(self, drain_timeout_s: float, why: str) -> int:
        """Let the requests here finish until the deadline, then give the rest up; returns how many
        were given up. New requests are refused meanwhile (the caller set a refusal)."""
        if await self._wait_idle(time.monotonic() + drain_timeout_s):
            return 0
        moved = await asyncio.wrap_future(self.engine.evacuate(why))
        log.info("%s: %d requests moved off after %.1fs", why, moved, drain_timeout_s)
        # Transfers cancelled mid-flight hold their blocks until the peer acknowledges the cancel
        # (or disagg.quarantine_timeout_s passes).
        grace = self.config.disagg.quarantine_timeout_s + 5.0
        if not await self._wait_idle(time.monotonic() + grace):
            raise APIError(
                503,
                f"the worker did not go idle within {grace:.0f}s of giving its requests up",
                code="drain_timeout",
            )
        return moved

    async def _swap_on_engine(self, role: str) -> bool:
        try:
            return await asyncio.wrap_future(self.engine.call(lambda e: self._swap(e, role)))
        except SwapFailed as e:
            if e.fatal:  # no connector at all: out of service for good, not a healthy-looking worker
                self.engine.dead = e
            raise APIError(503, str(e), code="switch_failed") from e

    async def leave(self, drain_timeout_s: float) -> dict:
        """Empty the worker before it stops (a scale-down): from now on it refuses new work for good."""
        self.leaving = True
        moved = await self._empty(drain_timeout_s, "worker leaving")
        self.moved_total += moved
        return self.describe(moved=moved)

    async def rejoin(self) -> dict:
        """Undo `leave` (its scale-down failed or was called off): new work is taken again."""
        if self.switching:
            raise APIError(409, "a role switch is under way", code="switching")
        if self.leaving:
            log.info("back in service: the scale-down did not go through")
        self.leaving = False
        return self.describe(moved=0)

    async def shed(self, count: int) -> dict:
        """Give up to `count` generating streams to the router, to be continued elsewhere."""
        if self.role not in ("decode", "mixed"):
            raise APIError(409, f"a {self.role} worker holds no streams to give up", "count", "not_streaming")
        if self.switching or self.leaving:
            raise APIError(409, "the worker is already giving up its requests", "count", "switching")
        moved = await asyncio.wrap_future(
            self.engine.evacuate("the decode pool is evening out its streams", count)
        )
        self.moved_total += moved
        log.info("gave up %d of its streams (asked for %d)", moved, count)
        return self.describe(moved=moved)

    def _swap(self, engine: LLMEngine, role: str) -> bool:
        """On the engine thread: close the old connector and open the new one; False while busy."""
        if engine.has_unfinished():
            return False
        wake = engine.connector.wake
        engine.connector.close()  # first: a fixed worker.kv_port is bound again by the new one
        try:
            build_connector(self.config, role, engine)
        except Exception as e:  # noqa: BLE001 - any failure: the old role's connector back
            log.exception("the %s KV connector could not be built; reopening the %s one", role, self.role)
            try:
                build_connector(self.config, self.role, engine)
            except Exception as again:  # noqa: BLE001
                raise SwapFailed(
                    f"the {role} KV connector could not be built ({e}), nor the {self.role} one "
                    f"again ({again})",
                    fatal=True,
                ) from again
            raise SwapFailed(
                f"the {role} KV connector could not be built ({e}); the worker is still {self.role}",
                fatal=False,
            ) from e
        finally:
            engine.connector.wake = wake
        return True

    def describe(self, moved: int) -> dict:
        return {
            "role": self.role,
            "kv_endpoint": getattr(self.engine.engine.connector, "endpoint", None),
            "moved": moved,
            "switches_total": self.switches_total,
        }


def install_role_route(app: FastAPI, switch: RoleSwitch) -> None:
    @app.post("/internal/role")
    async def set_role(change: RoleChange):
        drain = (
            change.drain_timeout_s
            if change.drain_timeout_s is not None
            else switch.config.server.shutdown_timeout_s
        )
        return RoleChanged(**await switch.switch(change.role, drain)).model_dump()

    @app.post("/internal/shed")
    async def shed(req: ShedRequest):
        return RoleChanged(**await switch.shed(req.count)).model_dump()

    @app.post("/internal/leave")
    async def leave(req: LeaveRequest):
        drain = (
            req.drain_timeout_s
            if req.drain_timeout_s is not None
            else switch.config.server.shutdown_timeout_s
        )
        return RoleChanged(**await switch.leave(drain)).model_dump()

    @app.post("/internal/rejoin")
    async def rejoin():
        return RoleChanged(**await switch.rejoin()).model_dump()
