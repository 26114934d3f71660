"""Scheduler decisions on synthetic requests: no model involved."""

from __future__ import annotations

import pytest

from pdserve.cache.block_pool import BlockPool, NoFreeBlocks
from pdserve.common.sampling import SamplingParams
from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=100))


def _advance(sched: Scheduler) -> dict[str, int]:
    """One step as the engine does it: commit the step, append a token where a chunk ends."""
    step = sched.schedule()
    sched.update(step)
    for req, _ in step.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
    return {r.request_id: n for r, n in step.scheduled}


def test_pool_refcounts_and_errors():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    pool.incref(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.refcount(a[0]) == 1
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free(a[:1])
    with pytest.raises(NoFreeBlocks):
        pool.allocate(5)


def test_chunked_prefill_respects_token_budget():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockPool(64), block_size=4)
    s.add(_req("a", 40))
    s.add(_req("b", 10))
    assert _advance(s) == {"a": 16}
    assert _advance(s) == {"a": 16}
    assert _advance(s) == {"a": 8, "b": 8}  # a's last chunk, then b starts with what is left
    assert _advance(s) == {"a": 1, "b": 2}  # a decodes, b finishes its prompt


def test_running_cap_and_fcfs_admission():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), BlockPool(64), block_size=4)
    for rid in "abc":
        s.add(_req(rid, 4))
    assert set(_advance(s)) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]
    s.finish(s.running[0], "stop")
    assert set(_advance(s)) == {"b", "c"}


def test_admission_waits_for_free_blocks_in_order():
    # 6 blocks of 4: "a" takes 4 blocks; "b" (3 blocks) must wait, and "c" may not jump ahead of it.
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, watermark_blocks=0), BlockPool(6), block_size=4)
    s.add(_req("a", 16))
    s.add(_req("b", 12))
    s.add(_req("c", 4))
    assert set(_advance(s)) == {"a"}
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_preemption_recomputes_latest_and_returns_blocks():
    pool = BlockPool(4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, watermark_blocks=0), pool, block_size=4)
    s.add(_req("a", 7))
    s.add(_req("b", 7))
    assert set(_advance(s)) == {"a", "b"}  # 2 blocks each, pool full
    a, b = s.running
    _advance(s)  # 8 tokens each now fit exactly
    step = s.schedule()  # both need a third block: b (newest) is preempted
    assert [r.request_id for r in step.preempted] == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert s.waiting[0] is b and b.num_preemptions == 1
    assert [r.request_id for r, _ in step.scheduled] == ["a"]
    s.finish(a, "stop")
    s.finish(b, "abort")
    assert pool.num_free == pool.num_blocks


def test_lone_request_without_blocks_preempts_itself_not_others():
    pool = BlockPool(2)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, watermark_blocks=0), pool, block_size=4)
    s.add(_req("a", 8))
    _advance(s)
    step = s.schedule()  # needs a third block: nothing else to evict
    assert step.preempted[0].request_id == "a" and not step.scheduled
    assert pool.num_free == 2


def test_finish_frees_waiting_and_running():
    pool = BlockPool(8)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100), pool, block_size=4)
    s.add(_req("a", 5))
    s.add(_req("b", 5))
    _advance(s)
    for r in list(s.running) + list(s.waiting):
        s.finish(r, "abort")
    assert not s.has_unfinished() and pool.num_free == 8


def test_blocks_computed_after_a_diverged_chain_are_not_cached_under_another_requests_block():
    # "a" replies, finishes, and stays cached. "b" has the same prompt: its last prompt block is never
    # a hit (one token is always computed), so it recomputes it into its own block, and with the same
    # reply that block's hash is a's. b's later blocks must not hang under a's block, which b does not
    # hold: that block would count as free while it could not be evicted (NoFreeBlocks mid-step).
    from pdserve.cache.prefix_cache import PrefixCache

    pool = BlockPool(8, PrefixCache(4))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, watermark_blocks=0), pool, block_size=4)

    def run(rid: str, replies: list[int]) -> Request:
        req = _req(rid, 6)
        s.add(req)
        for tok in replies:
            step = s.schedule()
            s.update(step)
            for r, _ in step.scheduled:
                r.append_token(tok)
        return req

    a = run("a", [7, 7, 7, 7, 7, 7, 7])  # 13 tokens, 12 computed: three cached blocks
    s.finish(a, "stop")
    b = run("b", [7, 7, 8, 8, 8, 8, 8, 8, 8, 8])  # same first block of reply, then another
    assert b.num_computed_tokens == 15
    pool.check_integrity()
    pool.free(pool.allocate(pool.num_free))  # every block counted as free can be had
    s.finish(b, "stop")
    assert pool.num_free == pool.num_blocks


def test_one_admission_test_keeps_the_watermark_back_while_a_request_loads():
    """Every admission path asks _fits: with a request loading from a peer (nothing running yet), a
    local prefill may not take the watermark blocks the loading request will decode into."""
    pool = BlockPool(10)
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=100, watermark_blocks=2),
        pool,
        block_size=4,
        local_prefill_max_tokens=8,
    )
    loading = _req("l", 16)
    loading.prefill_peers = ["tcp://peer:1"]
    s.add(loading)
    assert s.schedule().to_load == [loading] and pool.num_free == 6
    s.add(_req("m", 20))  # 5 blocks: 6 free, but 2 are the watermark
    assert s.schedule().scheduled == [] and not s.running
    s.finish(loading, "abort")
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["m"]


def test_update_commits_a_step_and_schedule_stays_short():
    import inspect

    s = Scheduler(SchedulerConfig(max_num_batched_tokens=6, watermark_blocks=0), BlockPool(8), block_size=4)
    req = _req("a", 10)
    s.add(req)
    step = s.schedule()
    assert s.update(step) == (6, 0) and req.num_computed_tokens == 6
    assert s.update(s.schedule()) == (4, 0) and req.num_computed_tokens == 10
    assert len(inspect.getsource(Scheduler.schedule).splitlines()) < 50
