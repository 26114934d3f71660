"""Shared-memory files: mapping another process's (a KV pool) into this one safely, and removing
those whose maker is gone."""

from __future__ import annotations

import mmap
import os
import re
import stat
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")


def pid_alive(pid: int) -> bool:
    """Whether a process on this host still runs. A killed child its parent has not reaped yet is
    a zombie: signal 0 still reaches it, so /proc is asked first."""
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
        return st[st.rindex(")") + 2] not in "ZX"
    except FileNotFoundError:
        return False
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: Path, prefix: str) -> list[Path]:
    """Remove the files of `directory` named `<prefix>-<pid>-<hex>` whose process no longer runs
    (one killed with -9, or before it could unlink what it made); returns them."""
    if not directory.is_dir():
        return []
    name = re.compile(re.escape(prefix) + r"-(\d+)-[0-9a-f]+$")
    gone = []
    for p in directory.glob(prefix + "-*"):
        m = name.fullmatch(p.name)
        if m and not pid_alive(int(m.group(1))):
            try:
                p.unlink()
                gone.append(p)
            except FileNotFoundError:
                pass
    return gone


def attach_shared_kv(path: str | Path, shape: tuple[int, ...], elem_size: int) -> np.ndarray:
    """Map another process's pool as raw bytes [layers, planes, slots, heads, dim * elem_size]."""
    size = int(np.prod(shape)) * elem_size
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a symlink planted at a pool's name is refused
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{path}: expected {size} bytes, found {os.fstat(fd).st_size}")
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return np.frombuffer(buf, dtype=np.uint8).reshape(*shape[:-1], shape[-1] * elem_size)
