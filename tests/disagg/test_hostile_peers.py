"""A hostile peer against a real deployment: a router, a prefill worker and a decode worker (separate
processes sharing an internal token), and this process sending, over real sockets, what a peer on
the network could send to each internal socket: unsigned and wrongly signed messages, frames over
the size limits, garbage, a replayed job, out-of-range jobs and answers, and ~1,000 messages each
naming its own reply endpoint. Afterwards both workers serve an ordinary request through the
router with the same greedy output as before, every KV block is back, and their file descriptors
have not grown with the messages."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
import yaml
import zmq
from kv_peers import DecodePeer, sign
from pd_harness import pd_config

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.model.loader import load_model_files
from pdserve.protocol import PD_ACCEPTED, PD_BAD_JOB, PD_CANCEL, PD_DONE, PD_FAILED, PD_LAYER, pack
from pdserve.server.roles import build_engine

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
TOKEN = "hostile-peer-suite-token"
KEY = TOKEN.encode()
PROMPT = [(7 * j) % 250 + 1 for j in range(24)]  # 6 blocks of 4: prefilled remotely (more than 8)
FLOOD = 1000
# What the workers may open beyond their start for a flood of reply endpoints: the bounded reply
# sockets (64, each a mailbox descriptor and at most a connecting one), and slack for the rest.
FD_SLACK = 2 * 64 + 40
CONFIG = {
    "model": {"name": MODEL},
    "server": {"internal_token": TOKEN},
    "cache": {"block_size": 4, "device_blocks": 64},
    "scheduler": {"max_num_batched_tokens": 16},
    "transfer": {"backend": "tcp"},
}


def _proc(tmp_path, name: str, args: list[str], cfg: dict) -> ServerProcess:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    return ServerProcess(
        pdserve_cmd() + args + ["--config", str(path), "--port", str(port)], port, tmp_path / f"{name}.log"
    )


def _health(p: ServerProcess) -> dict:
    return httpx.get(p.url + "/health", timeout=10).json()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _complete(client: openai.OpenAI, salt: str) -> str:
    """Greedy tokens of PROMPT; a new salt each time, so nothing comes from a prefix cache."""
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"cache_salt": salt, "ignore_eos": True},
    )
    return out.choices[0].text


def _closed_ports(n: int) -> list[str]:
    return [f"tcp://127.0.0.1:{1 + i}" for i in range(n)]


def _sign(msg: dict, key: bytes | None) -> bytes:
    return pack(sign(msg, key))


def _send_alone(endpoint: str, frames: list[bytes]) -> None:
    """Over a connection of their own: a frame over the limit drops its connection, and with it
    whatever was queued behind it."""
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 5000)
    s.connect(endpoint)
    for f in frames:
        s.send(f)
    s.close()


def _frame_of(size: int) -> bytes:
    """A msgpack map of exactly `size` bytes."""
    base = {"type": PD_DONE, "request_id": "big", "transfer_id": "big", "pad": b""}
    return pack({**base, "pad": b"\0" * (size - len(pack(base)) - 3)})  # bin 32 header: 3 more bytes


def _wait(cond, what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.2)


def _attack_prefill(endpoint: str, vocab: int) -> None:
    local = build_engine(pd_config("prefill", "tcp"))  # configured like the worker: jobs that fit it
    peer = DecodePeer(local, endpoint)
    try:
        slots = local.kv_cache.shape[2]
        for ep in _closed_ports(FLOOD):  # never answered: no socket for any of these
            peer.send(peer.job(PROMPT, reply_endpoint=ep))
        for ep in _closed_ports(FLOOD):  # wrongly signed
            peer.send(peer.job(PROMPT, reply_endpoint=ep), b"not-the-token")
        # Signed (a peer that holds the token) but out of range: each refused, at its own endpoint.
        for i, ep in enumerate(_closed_ports(FLOOD)):
            bad = [
                {"dst_block_ids": [0, 1, 2, 3, 4, slots // 4 + i]},
                {"prompt_token_ids": [vocab + i] * 24},
                {"transfer_id": ""},
                {"max_model_len": 4},
            ][i % 4]
            peer.send(peer.job(PROMPT, reply_endpoint=ep, **bad), KEY)
        _send_alone(endpoint, [_frame_of(16 << 20), b"\xc1garbage"])
        for frame in (b"\xc1garbage", pack([1, 2, 3]), pack({"type": 7})):
            peer.push.send(frame)
        peer.push.send_multipart(
            [
                _sign(
                    {
                        "type": PD_CANCEL,
                        "request_id": "x",
                        "transfer_id": "y",
                        "reply_endpoint": peer.endpoint,
                    },
                    None,
                ),
                b"more",
            ]
        )
        # A replay: the same signed job twice; the first runs, the second is refused.
        job = peer.job(PROMPT)
        peer.send(job, KEY)
        assert peer.until((PD_DONE, PD_FAILED), timeout=120)[-1]["type"] == PD_DONE
        peer.send(job, KEY)
        reply = peer.until((PD_FAILED,), timeout=120)[-1]
        assert reply["code"] == PD_BAD_JOB and "used before" in reply["reason"], reply
    finally:
        peer.close()
        local.connector.close()


def _attack_decode(endpoint: str, vocab: int) -> None:
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 5000)
    s.connect(endpoint)
    try:
        for i in range(FLOOD):
            ids = {"request_id": f"r{i}", "transfer_id": f"t{i}"}
            s.send(_sign({"type": PD_DONE, **ids, "token": 1}, None))  # unsigned
            s.send(_sign({"type": PD_ACCEPTED, **ids, "pid": 1}, b"not-the-token"))  # wrongly signed
            s.send(_sign({"type": PD_DONE, **ids, "token": vocab + i}, KEY))  # out of range, no transfer
            s.send_multipart(
                [
                    _sign({"type": PD_LAYER, **ids, "layer": 0, "runs": [[0, 10**9]], "data": True}, KEY),
                    b"\xff" * 64,
                    b"\xff" * 64,
                ]
            )  # blocks not its own
        for frame in (b"\xc1garbage", pack({"type": PD_DONE, "request_id": ["x"]})):
            s.send(frame)
    finally:
        s.close()
    _send_alone(endpoint, [_frame_of(64 << 20), b"\xc1garbage"])


def test_hostile_peers_leave_every_worker_serving_whole_and_bounded(tmp_path):
    pkv, dkv = free_port(), free_port()
    with (
        _proc(tmp_path, "prefill", ["worker", "--role", "prefill", "--kv-port", str(pkv)], CONFIG) as prefill,
        _proc(
            tmp_path,
            "decode",
            [
                "worker",
                "--role",
                "decode",
                "--kv-port",
                str(dkv),
                "--prefill-endpoints",
                f"tcp://127.0.0.1:{pkv}",
            ],
            {**CONFIG, "disagg": {"local_prefill_max_tokens": 8}},
        ) as decode,
    ):
        prefill.wait_ready(timeout=180)
        decode.wait_ready(timeout=180)
        with _proc(
            tmp_path,
            "router",
            ["router", "--worker", f"prefill={prefill.url}", "--worker", f"decode={decode.url}"],
            {"model": {"name": MODEL}, "server": {"internal_token": TOKEN}},
        ) as router:
            router.wait_ready(timeout=180)
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            deadline = time.monotonic() + 120  # until the router has seen both workers healthy
            while True:
                try:
                    want = _complete(client, "before")
                    break
                except openai.APIError:
                    assert time.monotonic() < deadline, router.log_tail()
                    time.sleep(0.5)
            p0, d0 = _health(prefill), _health(decode)
            assert p0["kv_prefill_jobs_total"] >= 1, "the request went through the prefill worker"
            fds0 = {"prefill": _fds(p0["pid"]), "decode": _fds(d0["pid"])}
            vocab = load_model_files(MODEL).arch.vocab_size

            _attack_prefill(f"tcp://127.0.0.1:{pkv}", vocab)
            _attack_decode(f"tcp://127.0.0.1:{dkv}", vocab)

            # The replay's refusal came after every message before it on that socket was handled:
            # each signed job refused and answered, at its own endpoint.
            _wait(lambda: _health(decode)["kv_messages_dropped_total"] >= 2 * FLOOD, lambda: _health(decode))
            p1, d1 = _health(prefill), _health(decode)
            assert p1["kv_messages_rejected_total"] - p0["kv_messages_rejected_total"] >= 2 * FLOOD
            assert (
                p1["kv_prefill_jobs_refused_total"] - p0["kv_prefill_jobs_refused_total"]
                >= 3 * FLOOD // 4 + 1
            )
            assert d1["kv_messages_rejected_total"] - d0["kv_messages_rejected_total"] >= 2 * FLOOD
            assert _fds(p1["pid"]) - fds0["prefill"] < FD_SLACK, (fds0, _fds(p1["pid"]))
            assert _fds(d1["pid"]) - fds0["decode"] < FD_SLACK, (fds0, _fds(d1["pid"]))
            assert p1["kv_reply_sockets_open"] <= 64

            # Both workers serve on, through the prefill worker, with the same greedy output.
            assert _complete(client, "after") == want
            p2, d2 = _health(prefill), _health(decode)
            assert p2["pid"] == p0["pid"] and d2["pid"] == d0["pid"]
            assert p2["kv_prefill_jobs_total"] == p1["kv_prefill_jobs_total"] + 1
            assert d2["kv_transfers_completed_total"] == d1["kv_transfers_completed_total"] + 1
            for p in (prefill, decode):
                _wait(
                    lambda p=p: _health(p)["kv_blocks_free"] == _health(p)["kv_blocks_total"],
                    lambda p=p: _health(p),
                )
            h = _health(decode)
            assert h["loading"] == 0 and h["kv_blocks_quarantined"] == 0, h
