"""A long prompt prefilled by two prefill workers in a layer-wise pipeline, one decode worker.

Three engines on their own threads, joined by their KV connectors over real sockets and the decode
worker's shared-memory pool. Greedy output must equal the mixed engine's (so a single prefill
worker's); every pool returns to its start, on success and when a chunk's worker fails.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from pd_harness import MODEL, Loop, mixed_outputs, pd_config, silent_peer

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.model.loader import load_model_files
from pdserve.server.roles import build_engine

PIPELINE = {"parallel_prefill_min_tokens": 32, "bootstrap_timeout_s": 0.5, "quarantine_timeout_s": 5.0}


@pytest.fixture(scope="module")
def loaded():
    return load_model_files(MODEL, 0)


def prefill_engine(loaded):
    # A chunk is computed in one step (the pipeline runs layer by layer within it).
    return build_engine(
        load_config(
            None,
            {
                "model.name": MODEL,
                "cache.device_blocks": 96,
                "cache.block_size": 4,
                "scheduler.max_num_batched_tokens": 256,
                "worker.role": "prefill",
            },
        ),
        loaded,
    )


@contextmanager
def pipeline(loaded, peers: list[str | None], **disagg):
    """Prefill workers for the None entries of `peers` (other entries: endpoints as given), and a
    decode worker that knows them in that order."""
    loops = {i: Loop(prefill_engine(loaded)) for i, p in enumerate(peers) if p is None}
    decode = None
    try:
        endpoints = [loops[i].engine.connector.endpoint if p is None else p for i, p in enumerate(peers)]
        decode = Loop(
            build_engine(
                pd_config("decode", "auto", 96, prefill_endpoints=endpoints, **{**PIPELINE, **disagg}), loaded
            )
        )
        yield decode, list(loops.values())
    finally:
        if decode is not None:
            decode.stop()
        for lp in loops.values():
            lp.stop()


def long_prompts() -> list[list[int]]:
    return [[(11 * i + 7 * j) % 250 + 1 for j in range(70 + 9 * i)] for i in range(3)]


def test_two_prefill_workers_in_a_pipeline_give_the_single_worker_output(loaded):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt_list = long_prompts() + [
        [(3 * j) % 250 + 1 for j in range(20)]
    ]  # the last one: below the threshold
    want = mixed_outputs(prompt_list, params, loaded)
    with pipeline(loaded, [None, None]) as (decode, prefills):
        decode.run(prompt_list, params)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_parallel_prefills_total"] == 3 and s["kv_parallel_prefill_chunks_total"] == 6
        assert s["kv_parallel_prefills_failed_total"] == 0 and s["kv_transfers_completed_total"] == 4
        for p in prefills:  # both computed: each worker wrote chunks of the three long prompts
            assert p.engine.stats()["kv_send_bytes_total"] > 0
        decode.wait_idle()
        for p in prefills:
            p.wait_idle()


def test_a_repeated_prompt_hits_each_workers_cache_and_still_matches(loaded):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = long_prompts()[2]
    want = mixed_outputs([prompt], params, loaded)["r0"]
    with pipeline(loaded, [None, None], local_prefill_max_tokens=1) as (decode, prefills):
        for rid in ("a", "b"):
            decode.submit(lambda e, rid=rid: e.add_request(rid, prompt, params))
            decode.wait([rid])
            assert decode.outputs[rid] == want
        decode.wait_idle()
        for p in prefills:
            p.wait_idle()


@pytest.mark.parametrize("silent_at", [0, 1])
def test_a_silent_chunk_worker_falls_back_to_the_other_alone(loaded, silent_at):
    """One of the two chunk workers never answers: within the bootstrap deadline the pipeline is
    cancelled (the live worker acknowledges, which releases the held blocks) and the request is
    prefilled by the remaining worker alone, with the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = long_prompts()[1]
    want = mixed_outputs([prompt], params, loaded)["r0"]
    with silent_peer() as dead:
        peers: list[str | None] = [None, None]
        peers[silent_at] = dead
        with pipeline(loaded, peers) as (decode, prefills):
            decode.submit(lambda e: e.add_request("a", prompt, params))
            decode.wait(["a"])
            assert decode.outputs["a"] == want
            s = decode.engine.stats()
            assert s["kv_parallel_prefills_failed_total"] == 1 and s["kv_transfers_completed_total"] == 1
            assert s["kv_local_prefill_fallbacks_total"] == 0
            decode.wait_idle()  # the held blocks came back on the live worker's acknowledgement
            assert decode.engine.stats()["kv_blocks_quarantined"] == 0
            prefills[0].wait_idle()


def test_parity_depends_on_the_earlier_chunks_kv(loaded, monkeypatch):
    """The control: when the later chunk's worker does not copy the earlier chunk's KV in, outputs differ."""
    from pdserve.disagg import pipeline as pl

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt_list = long_prompts()
    want = mixed_outputs(prompt_list, params, loaded)
    monkeypatch.setattr(pl.ChunkPipeline, "copy_in", lambda self, st, layer: None)
    with pipeline(loaded, [None, None]) as (decode, _):
        decode.run(prompt_list, params)
        assert decode.engine.stats()["kv_parallel_prefills_total"] == 3
        assert decode.outputs != want
