"""Per-key token buckets for requests and tokens per minute, in a bounded table.

Without API keys a key is the client's address, so anyone who can open connections from many
addresses adds keys. The table therefore holds at most `max_keys` buckets, in least-recently-used
order: each admission touches its own key and looks at a few of the oldest ones, dropping those that
have refilled to full (a full bucket admits exactly what a missing one does); a new key that finds
the table full pushes the oldest one out. Every operation is O(1); no request scans the table.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_KEYS = 100_000
# Oldest buckets examined per admission: more than the one a new key can add, so idle keys drain.
_SWEEP = 4


@dataclass
class Bucket:
    """A token bucket refilled continuously at `per_minute / 60` per second, holding at most `per_minute`."""

    per_minute: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + max(0.0, now - self.updated) * self.per_minute / 60.0)
        self.updated = max(self.updated, now)

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60.0 / self.per_minute)

    def full_at(self, now: float) -> bool:
        """Refilled to the brim by `now` (the level stored is the one at `updated`)."""
        return self.level + max(0.0, now - self.updated) * self.per_minute / 60.0 >= self.per_minute


class BucketTable:
    """Buckets by key, least recently used first, at most `max_keys` of them."""

    def __init__(self, per_minute: float, max_keys: int = MAX_KEYS) -> None:
        self.per_minute = per_minute
        self.max_keys = max(1, max_keys)
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def __contains__(self, who: object) -> bool:
        return who in self._buckets

    def get(self, who: str, now: float) -> Bucket:
        """`who`'s bucket refilled to `now` (a full new one if it had none), now the most recent."""
        self._sweep(now)
        b = self._buckets.get(who)
        if b is None:
            while len(self._buckets) >= self.max_keys:
                self._buckets.popitem(last=False)  # the least recently used, full or not
            b = self._buckets[who] = Bucket(self.per_minute, self.per_minute, now)
        else:
            self._buckets.move_to_end(who)
        b.refill(now)
        return b

    def _sweep(self, now: float) -> None:
        for _ in range(_SWEEP):
            oldest = next(iter(self._buckets.values()), None)
            if oldest is None or not oldest.full_at(now):
                return
            self._buckets.popitem(last=False)


class RateLimiter:
    """Requests per minute are taken at admission; tokens per minute are charged when a request ends
    (its size is known then) and a key whose bucket is empty waits for it to refill."""

    def __init__(self, rpm: int | None, tpm: int | None, max_keys: int = MAX_KEYS) -> None:
        self.rpm, self.tpm = rpm, tpm
        self.requests = BucketTable(rpm or 1, max_keys)
        self.tokens = BucketTable(tpm or 1, max_keys)

    def admit(self, who: str, now: float) -> float:
        """0 when admitted, else the seconds to wait (for Retry-After)."""
        if self.tpm:
            t = self.tokens.get(who, now)
            if t.level <= 0:
                return t.seconds_until(1)
        if self.rpm:
            r = self.requests.get(who, now)
            if r.level < 1:
                return r.seconds_until(1)
            r.level -= 1
        return 0.0

    async def check(self, who: str, now: float) -> float:
        """admit() as the middleware calls it (shared_limits.py decides in Redis instead)."""
        return self.admit(who, now)

    def charge_tokens(self, who: str, n: int, now: float) -> None:
        if self.tpm:
            self.tokens.get(who, now).level -= n
