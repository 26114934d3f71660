"""Where pdserve keeps what it builds or measures once and reuses (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$PDSERVE_CACHE, else ~/.cache/pdserve: compiled kernels, measured row costs and the
    benchmarks' baseline installs live under it. Read at each call, so a test or a process that
    sets the variable after import is honoured."""
    return Path(os.environ.get("PDSERVE_CACHE") or "~/.cache/pdserve").expanduser()
