"""Where pdserve keeps what it builds or measures once and reuses (torch-free)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def measuring_alone(path: Path, what: str, timeout_s: float) -> Iterator[None]:
    """Runs the block holding `path`'s lock (a file beside it; the kernel releases it when its holder
    dies): processes that would measure the same cache together take turns, so the later ones read
    the first one's result rather than measuring (and choosing) again, and no measurement runs beside
    another. Past timeout_s, or where the lock file cannot be made, the block runs unlocked (logged)."""
    lock = path.with_name(path.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.warning("measuring %s without a lock (%s): %s", what, lock, e)
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning(
                        "measuring %s without its lock: another process held it %.0f s", what, timeout_s
                    )
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock, where held
