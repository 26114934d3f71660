"""Prefill and decode engines joined by their KV connectors, in one process, over real sockets.

Each engine steps on its own thread, as in a worker. Greedy outputs must equal the mixed engine's,
over shm and tcp, and both pools must return to their starting state on every path.
"""

from __future__ import annotations

import time

import pytest
from pd_harness import MODEL, Loop, mixed_outputs, pd_config, pd_pair, prompts, silent_peer

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.model.loader import load_model_files
from pdserve.server.roles import build_engine


@pytest.fixture(scope="module")
def loaded():
    return load_model_files(MODEL, 0)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_pd_equals_mixed(loaded, backend):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt_list = prompts(6) + [prompts(6)[5][:6]]  # the last one is short: prefilled locally
    want = mixed_outputs(prompt_list, params, loaded)

    with pd_pair(backend) as (prefill, decode):
        decode.run(prompt_list, params)
        assert decode.outputs == want
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 6 and s["kv_transfers_failed_total"] == 0
        assert prefill.engine.stats()["kv_send_bytes_total"] > 0
        decode.wait_idle()
        prefill.wait_idle()


def test_a_resumed_request_is_prefilled_by_the_prefill_worker_and_continues_exactly(loaded):
    # A stream migrated to this decode worker arrives with the tokens it already generated: the
    # prefill worker computes prompt + those tokens and samples the next one in sequence (seeded
    # draw by index, penalties over the outputs), so the decode worker never runs the long prefill.
    params = SamplingParams(temperature=0.9, seed=3, presence_penalty=0.5, max_tokens=14, ignore_eos=True)
    prompt = prompts(6)[5]
    full = mixed_outputs([prompt], params, loaded)["r0"]
    with pd_pair() as (prefill, decode):
        decode.submit(lambda e: e.add_request("m", prompt, params, output_token_ids=full[:6]))
        decode.wait(["m"])
        assert decode.outputs["m"] == full[6:]
        s = decode.engine.stats()
        assert s["kv_transfers_completed_total"] == 1 and s["prefill_tokens_computed"] == 0
        assert prefill.engine.stats()["kv_prefill_jobs_total"] == 1
        decode.wait_idle()
        prefill.wait_idle()


def test_silent_prefill_peer_falls_back_to_local(loaded):
    """A peer that accepts connections but never answers: the deadline fires, the request is
    prefilled locally, the quarantined blocks come back."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = prompts(3)[2]
    want = mixed_outputs([prompt], params, loaded)["r0"]
    with silent_peer() as dead:
        decode = Loop(
            build_engine(
                pd_config(
                    "decode", prefill_endpoints=[dead], bootstrap_timeout_s=0.3, quarantine_timeout_s=0.5
                )
            )
        )
        try:
            decode.submit(lambda e: e.add_request("a", prompt, params))
            decode.wait(["a"])
            assert decode.outputs["a"] == want
            s = decode.engine.stats()
            assert s["kv_transfers_failed_total"] == 1 and s["kv_local_prefill_fallbacks_total"] == 1
            decode.wait_idle()
            assert decode.engine.stats()["kv_blocks_quarantined"] == 0
        finally:
            decode.stop()


def test_failed_peer_retries_on_next_prefill_worker(loaded):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = prompts(4)[3]
    want = mixed_outputs([prompt], params, loaded)["r0"]
    with (
        silent_peer() as dead,
        pd_pair(peers_before=[dead], bootstrap_timeout_s=0.3, quarantine_timeout_s=0.5) as (prefill, decode),
    ):
        decode.submit(lambda e: e.add_request("a", prompt, params))
        decode.wait(["a"])
        assert decode.outputs["a"] == want
        s = decode.engine.stats()
        assert (s["kv_transfers_failed_total"], s["kv_transfers_completed_total"]) == (1, 1)
        assert s["kv_local_prefill_fallbacks_total"] == 0
        decode.wait_idle()
        prefill.wait_idle()


def test_abort_while_loading_frees_every_block(loaded):
    """A client that goes away while its KV is in flight: the prefill side stops, the decode side
    holds the blocks until the cancel is acknowledged, then both pools are whole again."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    slow_prefill = load_config(
        None,
        {
            "model.name": MODEL,
            "cache.device_blocks": 256,
            "cache.block_size": 4,
            "worker.role": "prefill",
            "scheduler.max_num_batched_tokens": 64,
            "transfer.bandwidth_limit": 20000,
        },
    )
    prompt = [(5 * j) % 250 + 1 for j in range(200)]  # 200 tokens x 512 B at 20 kB/s: ~5 s in flight
    with pd_pair(prefill_config=slow_prefill) as (prefill, decode):
        decode.submit(lambda e: e.add_request("a", prompt, params))
        deadline = time.monotonic() + 10
        while decode.engine.stats()["kv_transfers_transferring"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        decode.abort("a")
        decode.wait(["a"])
        assert decode.finished["a"] == "abort"
        decode.wait_idle()
        prefill.wait_idle()
        assert decode.engine.stats()["kv_blocks_quarantined"] == 0
        assert prefill.engine.stats()["kv_prefill_jobs_active"] == 0


def test_parity_depends_on_the_transferred_kv(loaded, monkeypatch):
    """The control for the parity tests: with the layer writes dropped, outputs differ."""
    from pdserve.disagg.transports.shm import ShmWriter

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt_list = prompts(4)[1:]
    want = mixed_outputs(prompt_list, params, loaded)
    monkeypatch.setattr(ShmWriter, "write_layer", lambda self, rid, layer, runs: 0)
    with pd_pair("shm") as (_, decode):
        decode.run(prompt_list, params)
        assert decode.outputs != want
