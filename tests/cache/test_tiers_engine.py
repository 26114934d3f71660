"""The tiered KV cache inside the engine, on the real default model.

A prompt's blocks are evicted from a tiny device pool into a lower tier, then the prompt runs
again: its prefix must come back from that tier (the prefill counter proves it was not
recomputed) and the greedy output must equal the first, fully computed, run: the same tokens,
and logprobs within float noise (KV restored into the wrong blocks can still yield the same few
tokens; it cannot yield the same logprobs).
"""

from __future__ import annotations

import random
import zlib

import httpx
import pytest

from pdserve import SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.bench.workloads import words
from pdserve.cache.prefix_cache import prompt_hashes
from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine

BS = 16
MAX_TOKENS = 8
LOGPROB_TOL = 1e-3  # the restored run computes the tail in another chunk shape: float noise only


def _engine(files, **cache) -> LLMEngine:
    # float32, as the session's float copy of the weights (smollm_files) and worker B below: the tiers'
    # namespace digests the weights as loaded, and auto would pack this copy to int4 where B loads the
    # file's blocks.
    overrides = {
        "cache.device_blocks": 12,
        "model.quantization": "none",
        **{f"cache.{k}": v for k, v in cache.items()},
    }
    return LLMEngine(load_config(None, overrides), loaded=files)


def _prompt(files, topic: str, blocks: int) -> list[int]:
    """Text of its own per topic (prompts share no block), cut to `blocks` full blocks plus 4 tokens
    (a partial block is always computed)."""
    ids = files.tokenizer.encode(
        f"Notes on {topic}: " + words(random.Random(zlib.crc32(topic.encode())), 220)
    )
    assert len(ids) >= blocks * BS + 4
    return ids[: blocks * BS + 4]


def _run(e: LLMEngine, rid: str, ids: list[int]) -> tuple[list[int], list[float], str]:
    e.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    tokens, logprobs, text = [], [], ""
    for out in e.run_until_idle(lambda _: e.pool.check_integrity()):
        tokens += out.new_token_ids
        logprobs += [lp.logprob for lp in out.new_logprobs]
        text += out.new_text
    assert e.pool.num_free == e.pool.num_blocks
    return tokens, logprobs, text


def _same(got, ref) -> bool:
    return got[0] == ref[0] and max(abs(a - b) for a, b in zip(got[1], ref[1])) < LOGPROB_TOL


def _evict_device(e: LLMEngine) -> None:
    """Take every block (evicting all cached ones through the engine's offload hook), give them back."""
    blocks = e.pool.allocate(e.pool.num_free)
    e.pool.free(blocks)
    assert len(e.prefix_cache) == 0
    assert e.tiers.store.flush(10)


def _computed(e: LLMEngine) -> int:
    return e.stats()["prefill_tokens_computed"]


@pytest.mark.slow
def test_prefix_restored_from_host_ram_gives_identical_output(smollm_files):
    e = _engine(smollm_files, host_cache_gb=0.05)
    try:
        p = _prompt(smollm_files, "colors", 6)
        ref = _run(e, "p1", p)
        _run(e, "evict", _prompt(smollm_files, "rivers", 11))  # needs the whole pool: evicts p's blocks
        assert e.prefix_cache.match(prompt_hashes(p, BS)) == []
        before = _computed(e)
        assert _same(_run(e, "p2", p), ref)
        s = e.stats()
        assert s["prefill_tokens_computed"] - before == len(p) - 6 * BS  # the 6 full blocks were loaded
        assert s["tier_host_hits_total"] >= 6 and s["tier_fetched_tokens_total"] >= 6 * BS
        assert s["tier_fetch_fallbacks_total"] == 0 and s["tier_loading"] == 0

        # The comparison is sensitive: the same blocks with their KV zeroed give other tokens.
        _evict_device(e)
        for h in prompt_hashes(p, BS)[:6]:
            e.tiers.store.host.get(h).zero_()
        assert not _same(_run(e, "p3", p), ref)
    finally:
        e.close()


@pytest.mark.slow
def test_prefix_restored_from_disk_gives_identical_output(smollm_files, tmp_path):
    e = _engine(smollm_files, disk_cache_dir=str(tmp_path), disk_cache_gb=0.05)  # no host tier
    try:
        p = _prompt(smollm_files, "fruit", 6)
        ref = _run(e, "p1", p)
        _evict_device(e)
        assert e.tiers.store.host is None and len(e.tiers.store.disk) >= 6
        before = _computed(e)
        assert _same(_run(e, "p2", p), ref)
        s = e.stats()
        assert s["prefill_tokens_computed"] - before == len(p) - 6 * BS
        assert s["tier_disk_hits_total"] == 6 and s["tier_disk_corrupt_total"] == 0
    finally:
        e.close()


@pytest.mark.slow
def test_corrupted_disk_block_is_recomputed_and_output_stays_correct(smollm_files, tmp_path):
    e = _engine(smollm_files, disk_cache_dir=str(tmp_path), disk_cache_gb=0.05)
    try:
        p = _prompt(smollm_files, "greetings", 6)
        ref = _run(e, "p1", p)
        _evict_device(e)
        path = e.tiers.store.disk.path(prompt_hashes(p, BS)[3])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte in block 3's KV payload
        path.write_bytes(bytes(data))
        before = _computed(e)
        assert _same(_run(e, "p2", p), ref)
        s = e.stats()
        assert s["tier_disk_corrupt_total"] == 1 and s["tier_disk_hits_total"] == 3
        assert s["prefill_tokens_computed"] - before == len(p) - 3 * BS  # blocks 3.. recomputed
        assert s["tier_fetch_fallbacks_total"] == 1
        assert not path.exists()  # the corrupt file is dropped, not served again
    finally:
        e.close()


@pytest.mark.slow
def test_eviction_order_and_budgets_through_the_engine(smollm_files, tmp_path):
    """Device evicts leaves first; host keeps the newest 3 blocks, spills LRU-first to a disk of 4."""
    probe = _engine(smollm_files)
    block_bytes = probe.kv_cache[:, :, :BS].numel() * probe.kv_cache.element_size()
    probe.close()
    e = _engine(
        smollm_files,
        host_cache_gb=3.5 * block_bytes / (1 << 30),
        disk_cache_dir=str(tmp_path),
        disk_cache_gb=4.5 * block_bytes / (1 << 30),
    )
    store = e.tiers.store
    try:
        prompts = [_prompt(smollm_files, q, 3) for q in ("colors", "fruit", "cities")]
        hashes = [prompt_hashes(p, BS)[:3] for p in prompts]
        refs = []
        for i, p in enumerate(prompts):
            refs.append(_run(e, f"r{i}", p))
            _evict_device(e)
            assert store.host.used_bytes <= store.host.budget_bytes
            assert store.disk.used_bytes <= store.disk.budget_bytes
        a, b, c = hashes
        assert store.host.keys() == [c[2], c[1], c[0]]  # leaf first off the device, head newest
        assert store.disk.keys() == [a[0], b[2], b[1], b[0]]  # a's leaves fell out of the disk first
        assert [store.lookup(h) for h in hashes] == [1, 3, 3]
        s = e.stats()
        assert s["tier_host_evictions_total"] == 6 and s["tier_disk_evictions_total"] == 2
        assert len(list(tmp_path.rglob("*.kv"))) == 4  # evicted files are deleted too
        before = _computed(e)
        assert _same(_run(e, "r0-again", prompts[0]), refs[0])  # one block from disk, the rest recomputed
        assert _computed(e) - before == len(prompts[0]) - BS
    finally:
        e.close()


@pytest.mark.slow
def test_second_worker_process_reuses_a_prefix_from_redis(smollm_files, redis_server, tmp_path):
    """Worker A computes the prefix and evicts it (write-through to Redis); worker B, another
    process that never saw the prompt, loads it from Redis and answers the same."""
    port = free_port()
    cmd = pdserve_cmd() + [
        "serve",
        "--mode",
        "mixed",
        "--model",
        "smollm2-135m",
        "--port",
        str(port),
        "--threads",
        "1",
        "--device-blocks",
        "12",
        "--kv-remote",
        redis_server.url,
        "--quantization",
        "none",
    ]
    with ServerProcess(cmd, port, tmp_path / "worker-b.log") as b:  # starts while A computes
        a = _engine(smollm_files, remote=redis_server.url)
        try:
            p = _prompt(smollm_files, "animals", 6)
            ref = _run(a, "p1", p)
            _evict_device(a)
            assert a.stats()["tier_remote_bytes_written_total"] >= 6 * 16 * 30 * 2 * 3 * 64 * 4
        finally:
            a.close()
        b.wait_ready(timeout=180)
        r = httpx.post(
            b.url + "/v1/completions",
            timeout=120,
            json={
                "model": "smollm2-135m",
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
            },
        )
        r.raise_for_status()
        choice = r.json()["choices"][0]
        assert choice["text"] == ref[2]
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref[1])) < LOGPROB_TOL
        s = httpx.get(b.url + "/health", timeout=10).json()
        assert s["tier_remote_hits_total"] == 6
        assert s["prefill_tokens_computed"] == len(p) - 6 * BS  # B computed only the tail
