"""Process helpers shared by the launcher, the router's tokenizer pool and the benchmarks (here, not
in launch.py, so the router's modules do not import the launcher: no cycle)."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """In a child before exec: get SIGTERM when the launcher dies, even by SIGKILL (Linux), so no
    worker outlives its deployment."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
