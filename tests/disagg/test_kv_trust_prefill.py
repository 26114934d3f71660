"""The prefill worker trusts no job it cannot check: a real prefill engine and its bootstrap socket,
hand-made jobs sent over real ZeroMQ sockets. A job without the internal token is never answered;
a refused signed job is answered with PD_FAILED and a code; neither runs (no job counted, no token
computed), and the pool stays as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kv_peers import DecodePeer
from pd_harness import Loop, pd_config, prompts

from pdserve.cache.kv_cache import SHM_DIR
from pdserve.protocol import PD_ACCEPTED, PD_BAD_JOB, PD_DONE, PD_FAILED, PD_TOO_LONG
from pdserve.server.roles import build_engine

TOKEN = "s3cret-internal-token"
PROMPT = prompts(3)[2]  # 20 tokens: 5 blocks of 4


def _prefill(backend: str = "tcp", token: str | None = None) -> Loop:
    return Loop(build_engine(pd_config("prefill", backend, overrides={"server.internal_token": token})))


def _never_ran(prefill: Loop) -> None:
    s = prefill.engine.stats()
    assert s["kv_prefill_jobs_total"] == 0 and s["prefill_tokens_computed"] == 0, s
    prefill.wait_idle()


def _refused(peer: DecodePeer, job: dict, code: str, key: bytes | None = None) -> dict:
    peer.send(job, key)
    reply = peer.next_reply()
    assert (reply["type"], reply.get("code"), reply.get("transfer_id")) == (
        PD_FAILED,
        code,
        job["transfer_id"],
    ), reply
    return reply


@pytest.fixture
def signed_prefill():
    prefill = _prefill(token=TOKEN)
    peer = DecodePeer(prefill.engine)
    yield prefill, peer
    peer.close()
    prefill.stop()


def test_a_job_without_the_token_or_with_a_wrong_one_is_never_answered(signed_prefill):
    prefill, peer = signed_prefill
    # A forged cancel is dropped too (it would abort someone's job), and neither job is answered:
    # an answer would go to an endpoint an unauthenticated sender chose.
    peer.send({"type": "cancel", "request_id": "x", "transfer_id": "y", "reply_endpoint": peer.endpoint})
    for key in (None, b"not-the-token"):
        peer.send(peer.job(PROMPT), key)
    # The control: the same job signed with the token runs, and its replies are signed. The socket
    # keeps order, so the first reply to come is this job's: the ones before got none.
    job = peer.job(PROMPT)
    peer.send(job, TOKEN.encode())
    replies = peer.until((PD_DONE, PD_FAILED))
    assert {r["transfer_id"] for r in replies} == {job["transfer_id"]}, replies
    assert [r["type"] for r in replies][0] == PD_ACCEPTED and replies[-1]["type"] == PD_DONE, replies
    assert all(r.get("auth") for r in replies)
    s = prefill.engine.stats()
    assert s["kv_messages_rejected_total"] == 3 and s["kv_prefill_jobs_total"] == 1
    assert s["kv_reply_sockets_open"] == 1  # the signed job's endpoint only
    prefill.wait_idle()


def test_a_replayed_transfer_id_is_refused():
    prefill = _prefill()
    peer = DecodePeer(prefill.engine)
    try:
        # Malformed ids are dropped (the engine thread keys on them) and the worker goes on.
        peer.send(
            {"type": "cancel", "request_id": ["x"], "transfer_id": "y", "reply_endpoint": peer.endpoint}
        )
        job = peer.job(PROMPT)
        peer.send(job)
        assert peer.until((PD_DONE, PD_FAILED))[-1]["type"] == PD_DONE
        reply = _refused(peer, job, PD_BAD_JOB)
        assert "used before" in reply["reason"]
        s = prefill.engine.stats()
        assert s["kv_prefill_jobs_total"] == 1 and s["kv_prefill_jobs_refused_total"] == 1
        prefill.wait_idle()
    finally:
        peer.close()
        prefill.stop()


@pytest.fixture
def foreign_file(tmp_path, request):
    """A file a job must not make the prefill worker write: /etc/passwd; a file of exactly the pool's
    size elsewhere; a symlink in /dev/shm under a pool's name pointing at such a file."""
    prefill = _prefill("shm")
    peer = DecodePeer(prefill.engine)
    size = prefill.engine.kv_cache.nbytes
    target = tmp_path / "pool-sized"
    target.write_bytes(bytes(size))
    link = SHM_DIR / f"pdserve-kv-{os.getpid()}-{os.urandom(4).hex()}"
    path = {"passwd": Path("/etc/passwd"), "tmp": target, "symlink": link}[request.param]
    if request.param == "symlink":
        link.symlink_to(target)
    before = path.read_bytes()
    try:
        yield prefill, peer, path
        assert path.read_bytes() == before
    finally:
        link.unlink(missing_ok=True)
        peer.close()
        prefill.stop()


@pytest.mark.parametrize("foreign_file", ["passwd", "tmp", "symlink"], indirect=True)
def test_a_job_naming_a_file_the_decode_worker_did_not_create_is_refused(foreign_file):
    prefill, peer, path = foreign_file
    reply = _refused(peer, peer.job(PROMPT, shm_path=str(path)), PD_BAD_JOB)
    assert "not a KV pool the decode worker created" in reply["reason"]
    _never_ran(prefill)


def test_a_job_naming_blocks_outside_the_decode_pool_is_refused():
    prefill = _prefill()
    peer = DecodePeer(prefill.engine)
    try:
        slots = prefill.engine.kv_cache.shape[2]
        _refused(peer, peer.job(PROMPT, dst_block_ids=[0, 1, 2, 3, slots // 4]), PD_BAD_JOB)
        _never_ran(prefill)
    finally:
        peer.close()
        prefill.stop()


def test_a_prompt_longer_than_the_decode_context_is_refused_before_any_prefill():
    prefill = _prefill()
    peer = DecodePeer(prefill.engine)
    try:
        reply = _refused(peer, peer.job(PROMPT, max_model_len=len(PROMPT)), PD_TOO_LONG)
        assert f"decode worker's {len(PROMPT)}" in reply["reason"]
        _never_ran(prefill)
    finally:
        peer.close()
        prefill.stop()


@pytest.mark.parametrize("change", ["heads", "slots", "layers", "elem_size", "start_block", "block_type"])
def test_a_job_whose_decode_pool_does_not_fit_this_model_is_refused(change):
    # The compatibility digest is the peer's word; the pool shape is what blocks and copies are
    # measured against (a pipelined chunk maps it on the engine thread).
    prefill = _prefill()
    peer = DecodePeer(prefill.engine)
    try:
        job = peer.job(PROMPT)
        shape = list(job["kv_shape"])
        bad = {
            "heads": {"kv_shape": [*shape[:3], shape[3] * 2, shape[4]]},
            "slots": {"kv_shape": [*shape[:2], 0, *shape[3:]]},
            "layers": {"kv_shape": [shape[0] + 1, *shape[1:]]},
            "elem_size": {"elem_size": job["elem_size"] * 2},
            "start_block": {"dst_start_block": len(job["dst_block_ids"]) + 1},
            "block_type": {"dst_block_ids": [0, 1, 2, 3, 4.0]},
        }[change]
        _refused(peer, {**job, **bad}, PD_BAD_JOB)
        _never_ran(prefill)
    finally:
        peer.close()
        prefill.stop()
