"""Radix prefix cache: hashing, matching, LRU leaf eviction, pool integration, engine parity."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cache.block_pool import BlockPool
from pdserve.cache.prefix_cache import PrefixCache, block_hash, prompt_hashes


def test_block_hash_is_stable_across_processes_and_salted():
    here = block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()
    code = (
        "from pdserve.cache.prefix_cache import block_hash;"
        "print(block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here == other
    assert block_hash(None, [1, 2, 3, 4], "tenant-a") != block_hash(None, [1, 2, 3, 4])
    assert prompt_hashes(list(range(10)), 4) == prompt_hashes(list(range(8)), 4)  # partial block ignored


def _cached_chain(cache: PrefixCache, pool: BlockPool, tokens: list[int]) -> list[int]:
    hashes = prompt_hashes(tokens, 4)
    blocks = pool.allocate(len(hashes))
    for i, (h, b) in enumerate(zip(hashes, blocks)):
        assert cache.insert(h, hashes[i - 1] if i else None, b)
    return blocks


def test_match_share_and_lru_leaf_eviction():
    cache = PrefixCache(4)
    pool = BlockPool(6, cache)
    a = _cached_chain(cache, pool, [1, 2, 3, 4, 5, 6, 7, 8])  # two blocks: a0 -> a1
    b = _cached_chain(cache, pool, [1, 2, 3, 4, 9, 9, 9, 9][4:])  # an unrelated root
    assert cache.match(prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0], 4)) == a
    assert cache.match(prompt_hashes([1, 2, 3, 4, 0, 0, 0, 0], 4)) == a[:1]
    pool.free(b)  # b becomes evictable first (older)
    pool.free(a)  # then a's leaf; a0 is not a leaf while a1 is cached
    assert pool.num_free == 6
    pool.check_integrity()
    got = pool.allocate(5)  # 3 truly free, then evict b, then a1 (leaves, LRU)
    assert set(got) == {*set(range(6)) - set(a) - set(b), b[0], a[1]}
    assert cache.match(prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)) == a[:1]
    pool.check_integrity()
    pool.incref(a[:1])  # a prefix hit takes the unreferenced block back
    assert pool.num_free == 0
    pool.free(a[:1])
    pool.free(got)
    pool.check_integrity()
    assert pool.num_free == 6


def test_insert_refuses_orphans_and_duplicates():
    cache = PrefixCache(4)
    h0, h1 = prompt_hashes(list(range(8)), 4)
    assert not cache.insert(h1, h0, 5)  # parent missing
    assert cache.insert(h0, None, 3)
    assert not cache.insert(h0, None, 4)  # already cached by block 3


@pytest.fixture(scope="module")
def system_prompt():
    rng = random.Random(0)
    words = "the a cat dog river city light music story garden water stone".split()
    return "You are a careful assistant. " + " ".join(rng.choice(words) for _ in range(120))


@pytest.mark.slow
def test_cached_and_uncached_greedy_outputs_identical(smollm_files, system_prompt):
    convs = [
        [{"role": "system", "content": system_prompt}, {"role": "user", "content": q}]
        for q in ["Name a color.", "What is 3 + 4?", "Say hello.", "Name a fruit."]
    ]
    params = SamplingParams(temperature=0, max_tokens=16)
    # float32: int4 products on an AVX512-BF16 CPU round activations by row count (docs/kernels.md),
    # and a cache hit changes how many prompt rows a step computes.
    plain = LLM(model="smollm2-135m", loaded=smollm_files, prefix_cache=False, quantization="none").chat(
        convs, params
    )
    cached = LLM(model="smollm2-135m", loaded=smollm_files, quantization="none")
    first = cached.chat(convs[:1], params)  # fills the cache with the system prompt
    rest = cached.chat(convs, params)  # every prompt now hits it
    assert [o.token_ids for o in plain] == [o.token_ids for o in first + rest[1:]]
    assert [o.token_ids for o in plain] == [o.token_ids for o in rest]
    stats = cached.engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 4 * 100
    cached.engine.pool.check_integrity()
    assert cached.engine.pool.num_free == cached.engine.pool.num_blocks


def test_concurrent_shared_prefix_with_aborts_keeps_pool_consistent():
    llm = LLM(model="tiny-llama", device_blocks=48, block_size=4, max_num_batched_tokens=32)
    eng, tok = llm.engine, llm.tokenizer
    prefix = tok.encode("shared system prompt " * 6)
    rng = random.Random(1)
    for i in range(24):
        eng.add_request(
            f"r{i}",
            prefix + tok.encode(f" question {i}"),
            SamplingParams(temperature=0, max_tokens=rng.randint(2, 12)),
        )
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps % 3 == 0:  # abort some requests mid-way
            live = sorted(eng.requests)
            if live:
                eng.abort_request(rng.choice(live))
        eng.pool.check_integrity()
    assert eng.prefix_cache.hit_tokens > 0
    assert eng.pool.num_free == eng.pool.num_blocks
    assert all(eng.pool.refcount(b) == 0 for b in range(eng.pool.num_blocks))


def test_cache_salt_separates_tenants():
    llm = LLM(model="tiny-llama", device_blocks=64, block_size=4)
    eng, ids = llm.engine, llm.tokenizer.encode("a prompt long enough to fill a few blocks " * 2)
    params = SamplingParams(temperature=0, max_tokens=2)

    def run(rid: str, salt: str | None) -> int:
        before = eng.prefix_cache.hit_tokens
        eng.add_request(rid, ids, params, cache_salt=salt)
        eng.run_until_idle()
        return eng.prefix_cache.hit_tokens - before

    assert run("a", "tenant-a") == 0
    assert run("b", "tenant-b") == 0  # same tokens, other tenant: no hit
    assert run("c", "tenant-a") > 0  # same tenant: hit
    eng.pool.check_integrity()


class _CountedSalt(str):
    """A salt that counts how often it is read for hashing."""

    reads = 0

    def encode(self, *args, **kwargs) -> bytes:
        type(self).reads += 1
        return super().encode(*args, **kwargs)


def test_a_salt_is_hashed_once_per_request_not_per_block():
    from pdserve.cache.prefix_cache import salt_key
    from pdserve.config import SchedulerConfig
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import Scheduler

    tokens = list(range(400))  # 100 blocks of 4
    salt = _CountedSalt("t" * 256)
    hashes = prompt_hashes(tokens, 4, salt)
    assert _CountedSalt.reads == 1 and len(hashes) == 100
    # The same chain from the salt's key, from the engine's side, and never the unsalted one.
    assert hashes == prompt_hashes(tokens, 4, salt_key("t" * 256)) != prompt_hashes(tokens, 4)
    assert hashes[0] == block_hash(None, tokens[:4], "t" * 256)
    _CountedSalt.reads = 0
    req = Request("r", tokens + [1], SamplingParams(max_tokens=1), cache_salt=salt)
    sched = Scheduler(SchedulerConfig(), BlockPool(128, PrefixCache(4)), 4)
    for n in range(1, 101):  # the scheduler extends the chain as blocks fill
        assert sched._hashes(req, n) == hashes[:n]
    assert _CountedSalt.reads == 1
