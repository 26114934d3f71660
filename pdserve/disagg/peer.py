"""Whether a peer worker's process is gone. On one host its pid answers at once, long before any
deadline would; for a peer on another host only the deadlines can tell."""

from __future__ import annotations

import socket

from pdserve.utils.shm import pid_alive

HOST = socket.gethostname()


def process_gone(pid: int | None, host: str | None) -> bool:
    """True only for a peer known to run on this host whose process no longer runs."""
    return pid is not None and host == HOST and not pid_alive(pid)


class LivenessClock:
    """Rate-limits the /proc lookups of a polling loop: `due(now)` is true at most once a period."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.period_s = period_s
        self._last = 0.0

    def due(self, now: float) -> bool:
        if now - self._last <= self.period_s:
            return False
        self._last = now
        return True
