"""Where pdserve keeps what it builds or measures once and reuses (torch-free)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """$PDSERVE_CACHE, else ~/.cache/pdserve: compiled kernels, measured row costs and the
    benchmarks' baseline installs live under it. Read at each call, so a test or a process that
    sets the variable after import is honoured."""
    return Path(os.environ.get("PDSERVE_CACHE") or "~/.cache/pdserve").expanduser()


def save_json(path: Path, data: Any, what: str) -> None:
    """`data` as JSON at `path`, written beside it and renamed: processes starting together never read
    half a file. A cache that cannot be written is logged (as `what`), not raised: it is measured again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache %s in %s: %s", what, path, e)
