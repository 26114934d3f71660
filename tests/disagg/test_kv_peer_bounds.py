"""What a peer's messages may cost a worker: real prefill and decode engines, hand-made messages over
real ZeroMQ sockets. Replies to endpoints a peer names use a bounded set of sockets; a frame
larger than any legitimate one is dropped by ZeroMQ before the HMAC check; a token id or a field
a peer gets wrong fails that request (blocks back in the pool), never the engine."""

from __future__ import annotations

import os
import time

import pytest
import zmq
from kv_peers import DecodePeer, PrefillPeer
from pd_harness import Loop, pd_config, prompts

from pdserve import SamplingParams
from pdserve.disagg.reply_sockets import IDLE_S, ReplySockets
from pdserve.protocol import PD_ACCEPTED, PD_DONE, PD_FAILED, PD_PREFILL, pack
from pdserve.server.roles import build_engine

TOKEN = "s3cret-internal-token"
PROMPT = prompts(3)[2]  # 20 tokens: 5 blocks of 4, prefilled remotely (more than 8)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # the peer's token only


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _closed_port_endpoints(n: int) -> list[str]:
    """Endpoints nobody listens on: a socket connected to one keeps reconnecting for good."""
    return [f"tcp://127.0.0.1:{1 + i}" for i in range(n)]


def _frame(msg: dict, field: str, size: int) -> bytes:
    """`msg` packed into exactly `size` bytes, padded with its `field` (bytes or str)."""
    unit = msg[field][:0]
    msg = {**msg, field: unit * 0}
    for _ in range(3):  # the length of the pad's msgpack header depends on the pad
        msg[field] = unit.__class__(
            ("a" if isinstance(unit, str) else b"\0") * (len(msg[field]) + size - len(pack(msg)))
        )
    data = pack(msg)
    assert len(data) == size
    return data


def _wait(cond, what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.02)


def test_reply_sockets_close_the_least_recently_used_and_the_idle_but_never_a_pinned_one():
    now = [0.0]
    socks = ReplySockets(zmq.Context.instance(), capacity=3, idle_s=10.0, clock=lambda: now[0])
    eps = _closed_port_endpoints(5)
    try:
        pinned = socks.pin(eps[0])
        for ep in eps[1:]:
            socks.get(ep)
        assert len(socks) == 3 and socks.get(eps[0]) is pinned  # eps[1], eps[2] went first
        assert socks.closed_total == 2
        now[0] = 11.0
        socks.sweep()
        assert len(socks) == 1 and socks.get(eps[0]) is pinned  # idle, but a writer holds it
        socks.unpin(eps[0])
        now[0] = 22.0
        socks.sweep()
        assert len(socks) == 0
        with pytest.raises(ValueError):
            socks.get("http://example.com/")  # not a ZeroMQ endpoint: no socket
    finally:
        socks.close()


def test_a_thousand_reply_endpoints_leave_the_prefill_workers_sockets_bounded():
    # No token (a loopback deployment): every job is verified, and a refused one is answered, each at
    # the endpoint it names. The answers need sockets; they must not accumulate.
    prefill = Loop(build_engine(pd_config("prefill", "tcp")))
    peer = DecodePeer(prefill.engine)
    try:
        before = _fds()
        for ep in _closed_port_endpoints(1000):
            peer.send(peer.job(PROMPT, transfer_id="", reply_endpoint=ep))  # refused: no transfer id
        # The control, last on the same socket: an ordinary job is answered and runs.
        job = peer.job(PROMPT)
        peer.send(job)
        assert peer.until((PD_DONE, PD_FAILED))[-1]["type"] == PD_DONE
        s = prefill.engine.stats()
        assert s["kv_prefill_jobs_refused_total"] == 1000 and s["kv_prefill_jobs_total"] == 1
        # Kept sockets keep their descriptors; one mid-reconnect, or another thread of this process,
        # holds one more for a moment. So the count must come under the bound, not be under it at one
        # instant (a loaded machine read 149), within a wait shorter than the pool's idle sweep
        # (reply_sockets.IDLE_S): nothing it holds can close meanwhile.
        _wait(
            lambda: _fds() - before < 2 * 64 + 20,
            lambda: f"{_fds() - before} more file descriptors after 1,000 reply endpoints",
            timeout=min(10.0, IDLE_S / 2),
        )
        assert s["kv_reply_sockets_open"] <= 64
        prefill.wait_idle()
    finally:
        peer.close()
        prefill.stop()


def test_a_frame_larger_than_any_job_never_reaches_the_prefill_workers_hmac_check():
    prefill = Loop(build_engine(pd_config("prefill", "tcp", overrides={"server.internal_token": TOKEN})))
    limit = prefill.engine.connector._bootstrap.getsockopt(zmq.MAXMSGSIZE)
    assert 0 < limit < 64 << 20, limit
    ctx = zmq.Context.instance()
    try:
        for size in (limit + 1, limit - 1):  # over the limit: dropped; under it: checked and refused
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(prefill.engine.connector.endpoint)
            s.send(
                _frame({"type": "prefill", "request_id": "big", "transfer_id": "x", "pad": b""}, "pad", size)
            )
            s.close()
        # The one under the limit is rejected for its missing signature; the one over never arrived.
        _wait(lambda: prefill.engine.stats()["kv_messages_rejected_total"] >= 1, prefill.engine.stats)
        time.sleep(0.5)
        assert prefill.engine.stats()["kv_messages_rejected_total"] == 1
    finally:
        prefill.stop()


@pytest.fixture
def decode_with_peer():
    peer = PrefillPeer()
    decode = Loop(
        build_engine(
            pd_config(
                "decode",
                "tcp",
                overrides={"server.internal_token": TOKEN},
                prefill_endpoints=[peer.endpoint],
                transfer_timeout_s=60,
                quarantine_timeout_s=1.0,
            )
        )
    )
    yield decode, peer, TOKEN.encode()
    decode.stop()
    peer.close()


def test_a_frame_larger_than_any_kv_run_never_reaches_the_decode_workers_hmac_check(decode_with_peer):
    decode, _, _ = decode_with_peer
    conn = decode.engine.connector
    limit = conn._pull.getsockopt(zmq.MAXMSGSIZE)
    raw = conn.raw
    assert limit == max(raw.shape[2] * raw.shape[3] * raw.shape[4], 1 << 20), limit
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(conn.endpoint)
    for size in (limit + 1, 1000):
        s.send(
            _frame(
                {"type": PD_DONE, "request_id": "x", "transfer_id": "y", "token": 1, "reason": ""},
                "reason",
                size,
            )
        )
    s.close()
    _wait(lambda: decode.engine.stats()["kv_messages_rejected_total"] >= 1, decode.engine.stats)
    time.sleep(0.5)
    assert decode.engine.stats()["kv_messages_rejected_total"] == 1


def _serve_one(decode: Loop, peer: PrefillPeer, key: bytes, rid: str, token: int, logprob=None) -> dict:
    """A request whose prefill peer answers its job with Accepted, then Done(token)."""
    decode.submit(lambda e: e.add_request(rid, PROMPT, ONE))
    job = peer.next_job()
    while job["type"] != PD_PREFILL:  # the cancel of an earlier transfer
        job = peer.next_job()
    ids = {"request_id": job["request_id"], "transfer_id": job["transfer_id"]}
    peer.send({"type": PD_ACCEPTED, **ids, "pid": os.getpid()}, key)
    peer.send({"type": PD_DONE, **ids, "token": token, "logprob": logprob}, key)
    decode.wait([rid])
    return job


@pytest.mark.parametrize("bad", ["vocab", "negative", "logprob"])
def test_a_first_token_outside_the_vocabulary_fails_the_request_not_the_decode_engine(decode_with_peer, bad):
    decode, peer, key = decode_with_peer
    vocab = decode.engine.arch.vocab_size
    token, logprob = {
        "vocab": (vocab, None),
        "negative": (-1, None),
        "logprob": (3, [3, -0.1, 1, [[3, -0.1], [vocab + 7, -2.0]]]),
    }[bad]
    _serve_one(decode, peer, key, "bad", token, logprob)
    assert decode.finished["bad"] == "error" and "outside the vocabulary" in decode.errors["bad"]
    assert decode.outputs.get("bad", []) == []
    # The engine lives on: the next request's token comes through, and every block is back.
    _serve_one(decode, peer, key, "good", 1)
    assert decode.outputs["good"] == [1] and decode.finished["good"] == "length"
    decode.wait_idle()


def test_a_peer_field_of_the_wrong_type_is_dropped_before_the_engine_sees_it(decode_with_peer):
    decode, peer, key = decode_with_peer
    decode.submit(lambda e: e.add_request("a", PROMPT, ONE))
    job = peer.next_job()
    ids = {"request_id": job["request_id"], "transfer_id": job["transfer_id"]}
    # The engine thread would look a pid up in /proc and add up the bytes.
    peer.send({"type": PD_ACCEPTED, **ids, "pid": "self"}, key)
    peer.send({"type": PD_DONE, **ids, "token": 1, "bytes": "many"}, key)
    peer.send({"type": PD_ACCEPTED, **ids, "pid": os.getpid()}, key)  # the control
    peer.send({"type": PD_DONE, **ids, "token": 1}, key)
    decode.wait(["a"])
    assert decode.outputs["a"] == [1] and decode.finished["a"] == "length"
    decode.wait_idle()


def test_a_pipelined_chunk_whose_done_is_out_of_range_fails_the_request_not_the_engine():
    peers = [PrefillPeer(), PrefillPeer()]
    decode = Loop(
        build_engine(
            pd_config(
                "decode",
                "auto",
                prefill_endpoints=[p.endpoint for p in peers],
                parallel_prefill_min_tokens=8,
                quarantine_timeout_s=1.0,
            )
        )
    )
    try:
        vocab = decode.engine.arch.vocab_size
        decode.submit(lambda e: e.add_request("long", PROMPT, ONE))
        jobs = [p.next_job() for p in peers]
        assert jobs[1]["upstream_tokens"] > 0, "pipelined over both peers"
        for p, job, token in zip(peers, jobs, (1, vocab + 1)):
            ids = {"request_id": job["request_id"], "transfer_id": job["transfer_id"]}
            p.send({"type": PD_ACCEPTED, **ids, "pid": os.getpid()})
            p.send({"type": PD_DONE, **ids, "token": token})
        decode.wait(["long"])
        assert decode.finished["long"] == "error" and "outside the vocabulary" in decode.errors["long"]
        decode.wait_idle()  # held until the quarantine deadline (the fake peers never ack)
        # The engine lives on: a short prompt is prefilled locally.
        decode.run([PROMPT[:6]], ONE)
        assert decode.finished["r0"] == "length"
        decode.wait_idle()
    finally:
        decode.stop()
        for p in peers:
            p.close()


@pytest.mark.parametrize(
    "host, token, warned", [("127.0.0.1", None, False), ("0.0.0.0", None, True), ("0.0.0.0", TOKEN, False)]
)
def test_a_kv_socket_open_beyond_loopback_without_a_token_is_warned_about(caplog, host, token, warned):
    engine = build_engine(
        pd_config("prefill", "tcp", overrides={"server.host": host, "server.internal_token": token})
    )
    try:
        assert any("no internal token is set" in r.getMessage() for r in caplog.records) == warned
    finally:
        engine.connector.close()
