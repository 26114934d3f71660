"""Which router replica's controller acts: a lease in Redis (controller.leader_lease).

Router replicas of one deployment each run a controller; all of them acting would add or switch a
worker once per replica for one shortage. The replica holding the lease acts; the others read and
export the pressure gauges only, as with controller.enabled false, and take the lease over once its
holder stops renewing it (it died, or lost Redis) for `lease_s`.

Renewal runs on its own clock, every lease_s / 3, not in the controller's step: an action that takes
long (a drain) keeps the lease. One atomic script renews the lease if this replica holds it or takes
it if nobody does, on Redis's clock.

Redis unreachable: a holder keeps acting until its lease would have expired (nobody else can take it
before), then no replica acts until Redis answers again: holding still is safer than every replica
scaling. A Redis restarted empty lets another replica take the lease at once; the old holder learns it
at its next renewal, so both may act for at most one renewal period.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import socket
from time import monotonic

log = logging.getLogger(__name__)
KEY_PREFIX = "pdserve:controller:leader:"

# KEYS: the lease; ARGV: this replica's id, the lease in ms. Returns the holder after the call.
ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return ARGV[1]
end
if cur then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""
# KEYS: the lease; ARGV: this replica's id. Deletes the lease only if this replica holds it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lease_key(deployment: str) -> str:
    """One lease per deployment (its served model name): deployments may share one Redis."""
    return KEY_PREFIX + hashlib.sha256(deployment.encode()).hexdigest()[:16]


class LeaderLease:
    def __init__(self, url: str, deployment: str, lease_s: float, *, timeout_s: float = 1.0) -> None:
        import redis.asyncio as aredis
        from redis.exceptions import RedisError

        self.url, self.key, self.lease_s = url, lease_key(deployment), lease_s
        self.me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._errors = (RedisError, OSError, asyncio.TimeoutError)
        self.client = aredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=2
        )
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self.holder: str | None = None  # as of the last answer from Redis
        self._held_until = 0.0  # monotonic: when this replica's lease expires at the latest
        self._unreachable = False

    @property
    def held(self) -> bool:
        return self.holder == self.me and monotonic() < self._held_until

    def describe(self) -> str:
        if self.held:
            return "this router holds the controller lease"
        if self._unreachable:
            return f"the controller lease's Redis ({self.url}) is unreachable"
        return f"router {self.holder or '(none)'} holds the controller lease"

    async def renew(self) -> bool:
        """Take or renew the lease; whether this replica holds it now."""
        sent = monotonic()
        try:
            holder = await self._acquire(keys=[self.key], args=[self.me, int(self.lease_s * 1000)])
        except self._errors as e:
            if not self._unreachable:
                log.warning("controller lease: Redis %s unreachable (%s)", self.url, e)
            self._unreachable = True
            return self.held
        self._unreachable = False
        holder = holder.decode() if isinstance(holder, bytes) else str(holder)
        if holder == self.me:
            if self.holder != self.me:
                log.info("controller lease: this router (%s) acts from now", self.me)
            # counted from before the call: Redis's expiry began no earlier
            self._held_until = sent + self.lease_s
        elif self.holder == self.me:
            log.warning("controller lease: taken over by %s", holder)
        self.holder = holder
        return self.held

    async def run(self) -> None:
        while True:
            await self.renew()
            await asyncio.sleep(self.lease_s / 3)

    async def release(self) -> None:
        """Hand the lease on at shutdown, so another replica takes it at its next renewal."""
        try:
            if self.holder == self.me:
                await self._release(keys=[self.key], args=[self.me])
        except self._errors as e:
            log.warning("controller lease: could not release it: %s", e)
        finally:
            self.holder, self._held_until = None, 0.0
            await self.client.aclose()
