"""What names and guards a model's blocks on a shared disk or Redis (engine/tier_identity.py):
- the namespace is a digest of the weights, not the directory's base name: two checkpoints in
  directories of the same name never share blocks; the same weights anywhere do; quantization,
  dtype, the cache's dtype and the served length each give other blocks;
- with an internal token the blocks' checksum is keyed: a block written without the key (by a
  process that can reach Redis or the disk but holds no token) is refused, and a worker with the
  key reads its own blocks back through the disk tier."""

from __future__ import annotations

import pytest
import torch

from pdserve.cache.tiers.codec import CorruptBlock, decode_block, encode_block
from pdserve.cache.tiers.disk import DiskTier
from pdserve.config import load_config
from pdserve.engine.tier_identity import tier_key, tier_namespace, weights_digest
from pdserve.model.arch import TINY_CONFIGS
from pdserve.model.loader import tiny_random_weights
from pdserve.model.quant import quantize

ARCH = TINY_CONFIGS["tiny-llama"]


def _ns(name: str, weights, **overrides) -> str:
    config = load_config(overrides={"model.name": "tiny-llama", **overrides})
    config.model.__dict__["name"] = name  # a checkpoint directory's path, as a user names it
    return tier_namespace(config, 256, weights, ARCH)


def test_two_checkpoints_in_directories_of_one_name_never_share_blocks():
    a, b = tiny_random_weights(ARCH, 0), tiny_random_weights(ARCH, 1)
    assert _ns("/models/team-a/model", a) != _ns("/models/team-b/model", b)
    # The same weights on another host, in another directory: the same blocks.
    assert _ns("/models/team-a/model", a) == _ns("/srv/model", dict(a))
    assert _ns("/m/model", a).startswith("model-")


def test_one_changed_value_changes_the_digest():
    a = tiny_random_weights(ARCH, 0)
    b = {k: v.clone() for k, v in a.items()}
    name = next(iter(sorted(b)))
    b[name].view(-1)[0] += 1.0  # the first element is always among those read
    assert weights_digest(a) != weights_digest(b)


def test_quantization_dtype_and_length_each_give_other_blocks():
    w = tiny_random_weights(ARCH, 0)
    base = _ns("/m/model", w)
    assert _ns("/m/model", w, **{"model.quantization": "int8"}) != base
    assert _ns("/m/model", w, **{"model.dtype": "bfloat16"}) != base
    # int8 weights' cache is bfloat16 by default, named as an explicit bfloat16 cache is.
    int8 = _ns("/m/model", w, **{"model.quantization": "int8", "cache.kv_dtype": "float32"})
    assert int8 not in (base, _ns("/m/model", w, **{"model.quantization": "int8"}))
    assert _ns("/m/model", w, **{"model.quantization": "int8"}) == _ns(
        "/m/model", w, **{"model.quantization": "int8", "cache.kv_dtype": "bfloat16"}
    )
    config = load_config(overrides={"model.name": "tiny-llama"})
    assert tier_namespace(config, 128, w) != tier_namespace(config, 256, w)
    # Quantized weights as loaded (a GGUF file's Q4 blocks) are digested through their parts.
    staged = {"w": quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)), "int4")}
    other = {"w": quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), "int4")}
    assert weights_digest(staged) != weights_digest(other)


def test_the_tier_key_comes_from_the_internal_token(monkeypatch):
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    assert tier_key(load_config()) is None
    k1 = tier_key(load_config(overrides={"server.internal_token": "s3cret"}))
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "s3cret")
    assert tier_key(load_config()) == k1 and k1 is not None and len(k1) == 32
    assert k1 != tier_key(load_config(overrides={"server.internal_token": "other"}))


H = bytes(range(16))
KEY = tier_key(load_config(overrides={"server.internal_token": "s3cret"}))


def test_a_block_planted_without_the_key_is_refused(tmp_path):
    block = torch.randn(2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(decode_block(encode_block(H, block, KEY), H, key=KEY), block)
    for forged in (encode_block(H, block), encode_block(H, block, b"x" * 32)):
        with pytest.raises(CorruptBlock, match="checksum"):
            decode_block(forged, H, key=KEY)
    # Through the disk tier: its own block loads, one planted in its place is dropped.
    disk = DiskTier(tmp_path, 1 << 20, key=KEY)
    assert disk.put(H, encode_block(H, block, KEY))
    assert torch.equal(disk.get(H), block)
    disk.path(H).write_bytes(encode_block(H, torch.zeros_like(block)))
    assert disk.get(H) is None and not disk.path(H).exists()
