"""Mapping another process's shared-memory file (a KV pool) into this one, safely."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import numpy as np


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
