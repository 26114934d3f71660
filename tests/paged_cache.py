"""A paged KV cache of random keys and values for the attention kernels' tests."""

import torch


def random_cache(g: torch.Generator, blocks: int, block: int, kvh: int, dim: int, kv_dtype=torch.float32):
    """Keys and values [blocks * block, kvh, dim] in `kv_dtype`, and the block ids in a random order
    (a test's block tables take them in turn, so no sequence's blocks are adjacent)."""
    kc = torch.randn(blocks * block, kvh, dim, generator=g).to(kv_dtype)
    vc = torch.randn(blocks * block, kvh, dim, generator=g).to(kv_dtype)
    return kc, vc, torch.randperm(blocks, generator=g).tolist()
