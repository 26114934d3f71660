"""Per-tier counters, updated from the engine thread and the tier threads alike."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # blocks that failed verification (and were dropped)
    errors: int = 0  # I/O or connection failures (treated as misses)
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    load_seconds_sum: float = 0.0  # latency of successful reads
    load_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self, prefix: str) -> dict[str, float]:
        with self._lock:
            return {
                f"{prefix}{f.name}": float(getattr(self, f.name))
                for f in fields(self)
                if not f.name.startswith("_")
            }
