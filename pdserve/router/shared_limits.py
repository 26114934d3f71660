"""Per-key rate limits shared by router replicas through Redis (`router.shared_limits`).

Each replica keeping its own buckets admits N times the configured limit behind N replicas. Here
the buckets live in Redis and one Lua script per decision reads, refills and takes from them
atomically, on Redis's clock (replicas' clocks may disagree), so N replicas together admit what one
would. The buckets are the ones of security.py's RateLimiter: `requests_per_minute` taken at
admission, `tokens_per_minute` charged when a request ends.

Fallback: Redis unreachable (or slower than `timeout_s`), a replica decides with its own local
buckets, as with no Redis at all (so N replicas admit up to N times the limit meanwhile), logs a
warning, counts `fallbacks`, and tries Redis again after `retry_after_s`. A limiter must never turn
a Redis outage into an API outage.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from pdserve.router.rate_limit import RateLimiter

log = logging.getLogger(__name__)
KEY_PREFIX = "pdserve:rl:"

# A bucket is a hash {l: level, t: when it had that level}, refilled continuously at per_minute/60 a
# second up to per_minute; idle buckets expire (a full one and a missing one are the same).
_LEVEL = """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) + tonumber(now_t[2]) / 1000000
local function level(key, per_min)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, ts = tonumber(v[1]), tonumber(v[2])
  if l == nil then return per_min end
  return math.min(per_min, l + math.max(0, now - ts) * per_min / 60)
end
local function store(key, l)
  redis.call('HSET', key, 'l', string.format('%.6f', l), 't', string.format('%.6f', now))
  redis.call('PEXPIRE', key, 120000)
end
"""
# KEYS: requests bucket, tokens bucket; ARGV: rpm, tpm (0: no limit). Returns the seconds to wait
# (a string: Lua numbers would be truncated to integers), "0" when admitted.
ADMIT = (
    _LEVEL
    + """
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 then
  local l = level(KEYS[2], tpm)
  if l <= 0 then return string.format('%.6f', (1 - l) * 60 / tpm) end
end
if rpm > 0 then
  local l = level(KEYS[1], rpm)
  if l < 1 then return string.format('%.6f', (1 - l) * 60 / rpm) end
  store(KEYS[1], l - 1)
end
return '0'
"""
)
# KEYS: tokens bucket; ARGV: tpm, tokens used.
CHARGE = (
    _LEVEL
    + """
store(KEYS[1], level(KEYS[1], tonumber(ARGV[1])) - tonumber(ARGV[2]))
return '0'
"""
)


POOL_CONNECTIONS = 16  # each decision is one short script call


class SharedRateLimiter(RateLimiter):
    def __init__(
        self,
        rpm: int | None,
        tpm: int | None,
        url: str,
        *,
        timeout_s: float = 0.25,
        retry_after_s: float = 5.0,
    ) -> None:
        super().__init__(rpm, tpm)
        import redis.asyncio as aredis
        from redis.exceptions import RedisError

        self.url = url
        self.retry_after_s = retry_after_s
        self._errors = (RedisError, OSError, asyncio.TimeoutError)
        # A bounded pool: under overload every request in flight would otherwise hold a connection of
        # its own, and the pool (and the router's fds) would grow to the peak. One that waits past
        # the timeout for a free connection is a decision taken locally, as with Redis down.
        pool = aredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
        self.client = aredis.Redis(connection_pool=pool)
        self._admit = self.client.register_script(ADMIT)
        self._charge = self.client.register_script(CHARGE)
        self._down_until = 0.0
        self._pending: set[asyncio.Task] = set()
        self.fallbacks = 0  # decisions taken locally because Redis was unreachable
        self.shared = 0  # decisions taken in Redis

    @staticmethod
    def _keys(who: str) -> list[str]:
        # Keys are key ids or client addresses; hashed so no caller text becomes a Redis key.
        h = hashlib.sha256(who.encode()).hexdigest()[:32]
        return [f"{KEY_PREFIX}req:{h}", f"{KEY_PREFIX}tok:{h}"]

    def _down(self, e: Exception) -> None:
        if time.monotonic() >= self._down_until:
            log.warning(
                "shared rate limits: Redis %s unreachable (%s); each replica limits alone for %.0fs",
                self.url,
                e,
                self.retry_after_s,
            )
        self._down_until = time.monotonic() + self.retry_after_s

    async def check(self, who: str, now: float) -> float:
        if not (self.rpm or self.tpm):
            return 0.0
        if time.monotonic() >= self._down_until:
            try:
                wait = float(await self._admit(keys=self._keys(who), args=[self.rpm or 0, self.tpm or 0]))
                self.shared += 1
                return wait
            except self._errors as e:
                self._down(e)
        self.fallbacks += 1
        return self.admit(who, now)

    def charge_tokens(self, who: str, n: int, now: float) -> None:
        if not self.tpm:
            return
        super().charge_tokens(who, n, now)  # the local bucket too: it decides while Redis is away
        if time.monotonic() < self._down_until:
            return
        try:
            task = asyncio.get_running_loop().create_task(self._charge_shared(who, n))
        except RuntimeError:  # no event loop (a test calling directly): the local charge stands
            return
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _charge_shared(self, who: str, n: int) -> None:
        try:
            await self._charge(keys=self._keys(who)[1:], args=[self.tpm or 0, n])
        except self._errors as e:
            self._down(e)

    async def close(self) -> None:
        await self.client.aclose()


def rate_limiter(rpm: int | None, tpm: int | None, shared_url: str | None) -> RateLimiter:
    """The router's limiter: shared through Redis when `router.shared_limits` names one."""
    if shared_url and (rpm or tpm):
        log.info("rate limits shared with the other router replicas through %s", shared_url)
        return SharedRateLimiter(rpm, tpm, shared_url)
    return RateLimiter(rpm, tpm)
