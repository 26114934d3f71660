"""Lower KV tiers below the device pool: host RAM, local disk, a shared remote (Redis)."""

from pdserve.cache.tiers.codec import CorruptBlock, decode_block, encode_block
from pdserve.cache.tiers.disk import DiskTier
from pdserve.cache.tiers.host import HostTier
from pdserve.cache.tiers.manager import TieredKVStore
from pdserve.cache.tiers.redis_tier import RedisTier

__all__ = [
    "CorruptBlock",
    "DiskTier",
    "HostTier",
    "RedisTier",
    "TieredKVStore",
    "decode_block",
    "encode_block",
]
