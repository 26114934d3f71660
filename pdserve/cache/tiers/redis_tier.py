"""Remote tier in Redis, shared by every worker: key pdserve:kv:[<namespace>:]<hash hex> -> codec bytes.

Redis is a cache here, never a dependency: any error is logged, counted and answered as a miss,
and after a failure the tier stays quiet for `retry_after_s` so a dead server costs one timeout,
not one per block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.cache.tiers.codec import CorruptBlock, decode_block
from pdserve.cache.tiers.stats import TierStats

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:kv:"
T = TypeVar("T")


class RedisTier:
    def __init__(
        self,
        url: str,
        *,
        ttl_s: int | None = None,
        namespace: str | None = None,
        timeout_s: float = 0.5,
        retry_after_s: float = 2.0,
        key: bytes | None = None,
    ) -> None:
        """`key`: the blocks' checksum key (codec.py), the same that wrote them."""
        self.url = url
        self.mac_key = key
        self.ttl_s = ttl_s
        self.prefix = KEY_PREFIX + (f"{namespace}:" if namespace else "")
        self.retry_after_s = retry_after_s
        self.stats = TierStats()
        # One quick retry covers a pooled connection that a Redis restart closed; no backoff sleeps.
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )
        self._down_until = 0.0
        self._lock = threading.Lock()

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        if not self.available:
            return default
        try:
            return fn()
        except (redis.RedisError, OSError) as e:
            with self._lock:
                was_up = self.available
                self._down_until = time.monotonic() + self.retry_after_s
            if was_up:  # one line per outage, not one per block
                log.warning(
                    "remote tier %s: %s failed (%s); treating it as empty for %.1fs",
                    self.url,
                    what,
                    e,
                    self.retry_after_s,
                )
            self.stats.add(errors=1)
            return default

    def put(self, block_hash: bytes, data: bytes) -> bool:
        ok = self._call("SET", lambda: self.client.set(self.key(block_hash), data, ex=self.ttl_s), None)
        if ok:
            self.stats.add(bytes_written=len(data))
        return bool(ok)

    def get(
        self, block_hash: bytes, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor | None:
        t0 = time.perf_counter()
        data: Any = self._call("GET", lambda: self.client.get(self.key(block_hash)), None)
        if data is None:
            self.stats.add(misses=1)
            return None
        try:
            block = decode_block(data, block_hash, shape=shape, dtype=dtype, key=self.mac_key)
        except CorruptBlock as e:
            log.warning("remote tier: dropping %s: %s", self.key(block_hash), e)
            self.stats.add(misses=1, corrupt=1)
            self.delete(block_hash)
            return None
        self.stats.add(hits=1, bytes_read=len(data), load_seconds_sum=time.perf_counter() - t0, load_count=1)
        return block

    def exists_many(self, hashes: list[bytes]) -> list[bool]:
        """One round trip (a pipeline of EXISTS); all False when Redis is unreachable."""
        if not hashes:
            return []

        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return [bool(n) for n in pipe.execute()]

        return self._call("EXISTS", run, [False] * len(hashes))

    def delete(self, block_hash: bytes) -> None:
        self._call("DEL", lambda: self.client.delete(self.key(block_hash)), None)

    def close(self) -> None:
        self.client.close()
