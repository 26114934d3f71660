"""The decode worker trusts no peer message it cannot place: a real decode engine whose prefill
peer is played by hand over real ZeroMQ sockets, and real prefill/decode pairs whose tokens or
compatibility digests differ. Every path ends with the pool back at its start."""

from __future__ import annotations

import time

import pytest
import torch
from kv_peers import PrefillPeer
from pd_harness import MODEL, Loop, mixed_outputs, pd_config, pd_pair, prompts

from pdserve import SamplingParams
from pdserve.config import load_config
from pdserve.deployment_plan import pd_kv_dtype
from pdserve.model.loader import load_model_files
from pdserve.protocol import PD_ACCEPTED, PD_DONE
from pdserve.server.roles import build_engine

TOKEN = "s3cret-internal-token"
PROMPT = prompts(3)[2]  # 20 tokens: 5 blocks of 4, prefilled remotely (more than 8)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # the peer's token only: no local KV


@pytest.fixture(scope="module")
def loaded():
    return load_model_files(MODEL, 0)


def _wait_stat(loop: Loop, key: str, value: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while loop.engine.stats()[key] != value:
        assert time.monotonic() < deadline, (key, loop.engine.stats())
        time.sleep(0.01)


def _block(loop: Loop, b: int) -> torch.Tensor:
    bs = loop.engine.block_size
    return loop.engine.kv_cache[0, :, b * bs : (b + 1) * bs]


@pytest.fixture
def decode_with_peer(request):
    token = getattr(request, "param", None)
    peer = PrefillPeer()
    decode = Loop(
        build_engine(
            pd_config(
                "decode",
                "tcp",
                overrides={"server.internal_token": token},
                prefill_endpoints=[peer.endpoint],
                transfer_timeout_s=60,
            )
        )
    )
    yield decode, peer, token.encode() if token else None
    decode.stop()
    peer.close()


def test_messages_for_unknown_or_finished_transfers_and_foreign_blocks_are_dropped(decode_with_peer):
    decode, peer, _ = decode_with_peer
    decode.submit(lambda e: e.add_request("a", PROMPT, ONE))
    job = peer.next_job()
    rid, tid, own = job["request_id"], job["transfer_id"], job["dst_block_ids"]
    foreign = next(b for b in range(decode.engine.pool.num_blocks - 1, -1, -1) if b not in own)
    frame = _block(decode, 0)[0].numel() * 4  # bytes of one block of one layer's K (float32)
    peer.send({"type": PD_ACCEPTED, "request_id": rid, "transfer_id": tid})
    peer.send_layer(rid, "never-started", [(own[0], 1)], frame, 0xFF)  # a transfer id it never started
    peer.send_layer(rid, tid, [(foreign, 1)], frame, 0xFF)  # blocks not its own
    peer.send_layer("nobody", tid, [(own[0], 1)], frame, 0xFF)  # a request it does not have
    peer.send({"type": PD_DONE, "request_id": rid, "transfer_id": "never-started", "token": 7})
    peer.send({"type": PD_DONE, "request_id": [rid], "transfer_id": tid, "token": 7})  # malformed: not a key
    # The control, after them on the same socket (processed in order): the live transfer's own
    # write lands and its PD_DONE completes it with its token.
    peer.send_layer(rid, tid, [(own[1], 1)], frame, 0x01)
    peer.send({"type": PD_DONE, "request_id": rid, "transfer_id": tid, "token": 1})
    decode.wait(["a"])
    assert decode.outputs["a"] == [1] and decode.finished["a"] == "length"
    assert _block(decode, own[1]).any()
    assert not _block(decode, own[0]).any() and not _block(decode, foreign).any()
    s = decode.engine.stats()
    assert s["kv_messages_dropped_total"] == 4 and s["kv_transfers_completed_total"] == 1
    # A second PD_DONE of the finished transfer is dropped and changes nothing.
    peer.send({"type": PD_DONE, "request_id": rid, "transfer_id": tid, "token": 2})
    _wait_stat(decode, "kv_messages_dropped_total", 5)
    assert decode.engine.stats()["kv_transfers_completed_total"] == 1
    decode.wait_idle()


@pytest.mark.parametrize("decode_with_peer", [TOKEN], indirect=True)
def test_unsigned_peer_messages_are_rejected(decode_with_peer):
    decode, peer, key = decode_with_peer
    decode.submit(lambda e: e.add_request("a", PROMPT, ONE))
    job = peer.next_job()
    assert job.get("auth"), "jobs are signed"
    rid, tid, own = job["request_id"], job["transfer_id"], job["dst_block_ids"]
    frame = _block(decode, 0)[0].numel() * 4
    peer.send({"type": PD_ACCEPTED, "request_id": rid, "transfer_id": tid}, key)
    peer.send_layer(rid, tid, [(own[0], 1)], frame, 0xFF, key=b"wrong")
    peer.send({"type": PD_DONE, "request_id": rid, "transfer_id": tid, "token": 7})
    peer.send({"type": PD_DONE, "request_id": rid, "transfer_id": tid, "token": 1}, key)
    decode.wait(["a"])
    assert decode.outputs["a"] == [1] and decode.finished["a"] == "length"
    assert not _block(decode, own[0]).any()
    assert decode.engine.stats()["kv_messages_rejected_total"] == 2
    decode.wait_idle()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_signed_pd_equals_mixed(loaded, backend):
    prompt_list = prompts(4)[1:]
    want = mixed_outputs(prompt_list, GREEDY, loaded)
    signed = {"server.internal_token": TOKEN}
    with pd_pair(
        backend, prefill_config=pd_config("prefill", backend, overrides=signed), decode_overrides=signed
    ) as (prefill, decode):
        decode.run(prompt_list, GREEDY)
        assert decode.outputs == want
        assert decode.engine.stats()["kv_transfers_completed_total"] == len(prompt_list)
        decode.wait_idle()
        prefill.wait_idle()


def test_a_wrong_token_never_runs_a_job_and_the_request_is_prefilled_locally(loaded):
    want = mixed_outputs([PROMPT], GREEDY, loaded)["r0"]
    # The prefill worker answers neither the job nor the cancel: the decode worker gives up on it
    # at the bootstrap deadline and, not knowing that nothing was written, holds the blocks until
    # the quarantine deadline.
    with pd_pair(
        prefill_config=pd_config("prefill", overrides={"server.internal_token": "prefill's"}),
        decode_overrides={"server.internal_token": "decode's"},
        quarantine_timeout_s=0.5,
        bootstrap_timeout_s=1.0,
    ) as (prefill, decode):
        decode.run([PROMPT], GREEDY)
        assert decode.outputs["r0"] == want
        s = decode.engine.stats()
        assert (s["kv_transfers_failed_total"], s["kv_local_prefill_fallbacks_total"]) == (1, 1)
        _wait_stat(prefill, "kv_messages_rejected_total", 2)  # the job, then the decode worker's cancel
        assert prefill.engine.stats()["kv_prefill_jobs_total"] == 0
        decode.wait_idle()
        prefill.wait_idle()


@pytest.mark.parametrize(
    "prefill_overrides, field",
    [({"cache.block_size": 8}, "block_size"), ({"model.dtype": "bfloat16"}, "dtype")],
)
def test_an_incompatible_prefill_worker_fails_the_request_at_once(prefill_overrides, field):
    with pd_pair(prefill_config=pd_config("prefill", overrides=prefill_overrides)) as (prefill, decode):
        decode.run([PROMPT], GREEDY)
        assert decode.finished["r0"] == "error" and decode.outputs.get("r0", []) == []
        error = decode.errors["r0"]
        assert "incompatible" in error and field in error, error
        s, p = decode.engine.stats(), prefill.engine.stats()
        assert s["kv_local_prefill_fallbacks_total"] == 0 and s["prefill_tokens_computed"] == 0
        assert p["kv_prefill_jobs_total"] == 0 and p["kv_prefill_jobs_refused_total"] == 1
        decode.wait_idle()  # the held blocks come back with the cancel's acknowledgement
        prefill.wait_idle()
        assert decode.engine.stats()["kv_blocks_quarantined"] == 0


def test_prefill_and_decode_may_quantize_their_weights_differently():
    # The decode role alone quantized: the KV both compute has one layout, and one dtype, the one the
    # deployment resolves for its workers (bfloat16: its decode role's weights are int8).
    kv = pd_kv_dtype(load_config(None, {"model.name": MODEL, "deployment.decode.quantization": "int8"}))
    assert kv == "bfloat16"
    prefill_config = pd_config("prefill", overrides={"cache.kv_dtype": kv})
    decode_overrides = {"model.quantization": "int8", "cache.kv_dtype": kv}
    with pd_pair(prefill_config=prefill_config, decode_overrides=decode_overrides) as (prefill, decode):
        decode.run([PROMPT], GREEDY)
        s = decode.engine.stats()
        assert (s["kv_transfers_completed_total"], s["kv_local_prefill_fallbacks_total"]) == (1, 0)
        assert prefill.engine.stats()["kv_prefill_jobs_refused_total"] == 0
        decode.wait_idle()
        prefill.wait_idle()
