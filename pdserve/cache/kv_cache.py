"""The KV tensors: one contiguous buffer [layers, 2 (k, v), num_blocks * block_size, kv_heads, head_dim],
or for multi-head latent attention (model/mla.py) [layers, 1, slots, 1, kv_lora_rank + qk_rope_head_dim]
(ModelArch.kv_layout): every mover copies [:, :, slots] and so moves either layout alike.

One buffer so that a layer's blocks are contiguous runs of memory that another process can map
(a decode worker's pool lives in a /dev/shm file that prefill workers write into directly).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
from pathlib import Path

import numpy as np
import torch

from pdserve.model.arch import ModelArch
from pdserve.utils.shm import SHM_DIR, sweep_stale

_SHM_NAME = re.compile(r"pdserve-kv-(\d+)-[0-9a-f]+$")


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    planes, heads, dim = arch.kv_layout
    return arch.num_layers * planes * block_size * heads * dim * elem


def num_blocks_for_budget(arch: ModelArch, block_size: int, dtype: torch.dtype, memory_gb: float) -> int:
    return max(1, int(memory_gb * (1 << 30)) // bytes_per_block(arch, block_size, dtype))


def kv_shape(arch: ModelArch, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return arch.kv_cache_shape(num_blocks * block_size)


def allocate_kv_cache(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shm_path: str | Path | None = None,
) -> torch.Tensor:
    shape = kv_shape(arch, num_blocks, block_size)
    if shm_path is not None:
        if torch.device(device).type != "cpu":
            raise ValueError("a shared-memory KV pool lives in host memory (device cpu)")
        kv = _shared_tensor(Path(shm_path), shape, dtype)
    else:
        kv = torch.empty(shape, dtype=dtype, device=device)
    # Write every page now: calloc'd zero pages would fault on first use, in the middle of serving.
    return kv.zero_()


def _shared_tensor(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    sweep_stale_shm()
    size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    atexit.register(_unlink, path)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def new_shm_path() -> Path:
    return SHM_DIR / f"pdserve-kv-{os.getpid()}-{os.urandom(4).hex()}"


def is_pool_path(path: str, pid: int | None) -> bool:
    """Whether `path` names a pool that process `pid` made with new_shm_path (a prefill worker maps
    nothing else, whatever a job says)."""
    d, name = os.path.split(path)
    m = _SHM_NAME.fullmatch(name)
    return d == str(SHM_DIR) and m is not None and int(m.group(1)) == pid


def sweep_stale_shm() -> None:
    """Remove pools left by killed workers (their pid no longer runs): kill -9 skips atexit."""
    sweep_stale(SHM_DIR, "pdserve-kv")


def raw_bytes_view(kv: torch.Tensor) -> np.ndarray:
    """The same memory as uint8 [layers, planes, slots, heads, dim * elem_size] (bfloat16 has no numpy dtype)."""
    es = kv.element_size()
    return kv.view(torch.uint8).numpy().reshape(*kv.shape[:-1], kv.shape[-1] * es)
