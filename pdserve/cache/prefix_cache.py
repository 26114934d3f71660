"""Radix prefix cache at block granularity (RadixAttention over KV blocks).

Each full block of tokens is a node of a trie, named by a chained hash of (parent hash, the
block's token ids, an optional per-tenant salt); looking a prompt up walks the trie one hash at
a time. Cached blocks are shared by reference count. A cached block that no request holds stays
in memory, evictable: leaves go first, least recently used first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.common.images import ImageInput, block_extra

# listener(kind, block_hash, parent): kind is "stored" (after an insert) or "removed" (after an eviction).
# An insert given the block's token ids passes them as a fourth argument (vLLM-format KV events carry them).
CacheListener = Callable[..., None]
# on_evict(block_id, block_hash): the block's KV is still intact; the id is reused right after.
EvictHook = Callable[[int, bytes], None]


def salt_key(salt: str | bytes | None) -> bytes | None:
    """A tenant's salt as it enters block hashes: digested once per request, not once per block."""
    if not salt or isinstance(salt, bytes):
        return salt or None
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"pdserve-salt").digest()


def block_hash(
    parent: bytes | None, token_ids: list[int], salt: str | bytes | None = None, extra: bytes | None = None
) -> bytes:
    """Stable across processes and machines (Python's hash() is salted per process). `salt`: the
    tenant's salt, or its `salt_key` (what a caller hashing many blocks passes). `extra`: what else
    the block's KV depends on, the digests of the images it overlaps (common/images.block_extra)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    key = salt_key(salt)
    if key:
        h.update(b"salt:" + key)
    if extra:
        h.update(b"extra:" + extra)
    return h.digest()


def prompt_hashes(
    token_ids: list[int], block_size: int, salt: str | bytes | None = None, images: Sequence[ImageInput] = ()
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (with `images`: of a VLM prompt's)."""
    out: list[bytes] = []
    parent = None
    salt = salt_key(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = block_extra(list(images), start, start + block_size) if images else None
        parent = block_hash(parent, token_ids[start : start + block_size], salt, extra)
        out.append(parent)
    return out


@dataclass
class _Node:
    block_id: int
    parent: bytes | None
    children: int = 0


class PrefixCache:
    def __init__(
        self, block_size: int, listener: CacheListener | None = None, on_evict: EvictHook | None = None
    ) -> None:
        self.block_size = block_size
        self.listener = listener  # feeds KV events (the router's global index)
        self.on_evict = on_evict  # lets the engine offload an evicted block's KV to a lower tier
        self.nodes: dict[bytes, _Node] = {}
        self.hash_of: dict[int, bytes] = {}  # block id -> its hash, for cached blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced leaves, LRU first
        self.unreferenced: set[int] = set()  # cached blocks with refcount 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self.nodes)

    # ------------------------------------------------------------------ lookup

    def match(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of these block hashes."""
        blocks = []
        for h in hashes:
            node = self.nodes.get(h)
            if node is None:
                break
            blocks.append(node.block_id)
        return blocks

    def record_query(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    # ------------------------------------------------------------------ insertion

    def insert(
        self, h: bytes, parent: bytes | None, block_id: int, token_ids: Sequence[int] | None = None
    ) -> bool:
        """Register a computed block. False when the hash is cached already (another block holds it)."""
        if h in self.nodes or block_id in self.hash_of:
            return False
        if parent is not None and parent not in self.nodes:
            return False  # the trie stays rooted: no orphans
        self.nodes[h] = _Node(block_id, parent)
        self.hash_of[block_id] = h
        if parent is not None:
            parent_node = self.nodes[parent]
            parent_node.children += 1
            self.evictable.pop(parent_node.block_id, None)  # no longer a leaf
        if self.listener is not None:
            if token_ids is None:
                self.listener("stored", h, parent)
            else:
                self.listener("stored", h, parent, token_ids)
        return True

    # ------------------------------------------------------------------ reference tracking (from the pool)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.hash_of

    def on_referenced(self, block_id: int) -> None:
        self.unreferenced.discard(block_id)
        self.evictable.pop(block_id, None)

    def on_unreferenced(self, block_id: int) -> None:
        self.unreferenced.add(block_id)
        if self.nodes[self.hash_of[block_id]].children == 0:
            self.evictable[block_id] = None
            self.evictable.move_to_end(block_id)

    @property
    def num_unreferenced(self) -> int:
        return len(self.unreferenced)

    def evict_one(self) -> int | None:
        """Drop the least recently used unreferenced leaf; returns its block id (now free)."""
        if not self.evictable:
            return None
        block_id = next(iter(self.evictable))
        if self.on_evict is not None:
            # Before any change: the KV is intact, and a hook that raises leaves the cache consistent.
            self.on_evict(block_id, self.hash_of[block_id])
        del self.evictable[block_id]
        h = self.hash_of.pop(block_id)
        node = self.nodes.pop(h)
        self.unreferenced.discard(block_id)
        if node.parent is not None:
            parent = self.nodes[node.parent]
            parent.children -= 1
            if parent.children == 0 and parent.block_id in self.unreferenced:
                # A leaf now, and used no later than its evicted child, the oldest leaf: next in line.
                self.evictable[parent.block_id] = None
                self.evictable.move_to_end(parent.block_id, last=False)
        if self.listener is not None:
            self.listener("removed", h, node.parent)
        return block_id

    def check_integrity(self, refcount: list[int]) -> None:
        """Raise AssertionError if the trie, the LRU and the pool's refcounts disagree."""
        children: dict[bytes, int] = {}
        for h, node in self.nodes.items():
            assert self.hash_of.get(node.block_id) == h, f"block {node.block_id} hash mismatch"
            if node.parent is not None:
                assert node.parent in self.nodes, f"block {node.block_id} is orphaned"
                children[node.parent] = children.get(node.parent, 0) + 1
        for h, node in self.nodes.items():
            assert node.children == children.get(h, 0), f"block {node.block_id} child count"
            unref = refcount[node.block_id] == 0
            assert unref == (node.block_id in self.unreferenced), f"block {node.block_id} reference state"
            assert (unref and node.children == 0) == (node.block_id in self.evictable), (
                f"block {node.block_id} evictable state"
            )
        assert len(self.hash_of) == len(self.nodes)
