"""When to rebalance: only after imbalance has stayed high for a while.

A fixed period rebalances needlessly when load is steady and too late when it shifts; a single
bad step is noise. So the trigger fires when the measured max/mean rank load has exceeded a
threshold for `window` consecutive observations, then waits `cooldown` observations so the
new placement is judged on fresh measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def sustained(history: Sequence[float], threshold: float, window: int) -> bool:
    """True when the last `window` imbalance readings all exceed `threshold`."""
    if window < 1:
        raise ValueError("window must be >= 1")
    return len(history) >= window and all(x > threshold for x in history[-window:])


@dataclass
class ImbalanceTrigger:
    """Stateful wrapper over `sustained`: feed one imbalance reading per observation."""

    threshold: float = 1.25
    window: int = 8
    cooldown: int = 0
    _streak: int = field(default=0, init=False)
    _quiet: int = field(default=0, init=False)

    def __post_init__(self):
        if self.window < 1 or self.cooldown < 0:
            raise ValueError("window must be >= 1 and cooldown >= 0")

    def observe(self, imbalance: float) -> bool:
        """Record a reading; True means rebalance now (the streak then starts over)."""
        if self._quiet > 0:
            self._quiet -= 1
            return False
        self._streak = self._streak + 1 if imbalance > self.threshold else 0
        if self._streak >= self.window:
            self._streak, self._quiet = 0, self.cooldown
            return True
        return False

    def reset(self) -> None:
        self._streak = self._quiet = 0
