"""The KV tensors: one contiguous buffer [layers, 2 (k, v), num_blocks * block_size, kv_heads, head_dim].

One buffer so that a layer's blocks are contiguous and can later be mapped into another process.
"""
from __future__ import annotations

import torch

from pdserve.model.arch import ModelArch


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_blocks_for_budget(arch: ModelArch, block_size: int, dtype: torch.dtype, memory_gb: float) -> int:
    return max(1, int(memory_gb * (1 << 30)) // bytes_per_block(arch, block_size, dtype))


def allocate_kv_cache(arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    kv = torch.empty(arch.num_layers, 2, num_blocks * block_size, arch.num_kv_heads, arch.head_dim,
                     dtype=dtype, device=device)
    # Write every page now: calloc'd zero pages would fault on first use, in the middle of serving.
    return kv.zero_()
