"""Stand-ins for one side of the KV plane, over real ZeroMQ sockets, for the trust tests: a decode
peer that sends hand-made jobs to a real prefill worker, a prefill peer that answers a real decode
worker's jobs with hand-made messages. (tests/ is on the path: pyproject pythonpath.)"""

from __future__ import annotations

import hmac
import os
import time
from typing import Any

import zmq

import pdserve
from pdserve.config import served_names
from pdserve.disagg.peer import HOST
from pdserve.protocol import AUTH_FIELD, PD_LAYER, PrefillJob, pack, unpack


def sign(msg: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """The wire format written out again (not disagg/trust.py's code): an HMAC-SHA256, keyed with
    the internal token, of the msgpack of the message without its auth field."""
    if key is None:
        return msg
    body = {k: v for k, v in msg.items() if k != AUTH_FIELD}
    return {**msg, AUTH_FIELD: hmac.new(key, pack(body), "sha256").hexdigest()}


def _recv(sock: zmq.Socket, timeout: float) -> dict[str, Any]:
    assert sock.poll(int(timeout * 1000)), "no message from the peer"
    frames = sock.recv_multipart()  # a tcp layer header comes with its KV frames
    return unpack(frames[0])


class DecodePeer:
    """Sends jobs and cancels to a prefill worker's bootstrap socket; collects its replies."""

    def __init__(self, prefill_engine, endpoint: str | None = None) -> None:
        """`endpoint`: the bootstrap socket of a prefill worker configured like `prefill_engine`
        (a worker process), instead of that engine's own."""
        ctx = zmq.Context.instance()
        self.engine = prefill_engine
        self.replies = ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.replies.bind_to_random_port('tcp://127.0.0.1')}"
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)  # what a test sent goes out before close
        self.push.connect(endpoint or prefill_engine.connector.endpoint)

    def job(self, prompt: list[int], **changes) -> dict[str, Any]:
        """A well-formed job for a decode pool shaped like the prefill worker's own (its blocks
        0..n-1), from a decode worker of the same configuration."""
        e = self.engine
        kv, bs, mc = e.kv_cache, e.block_size, e.config.model
        nblocks = -(-len(prompt) // bs)
        model = served_names(e.config)[0]
        kv_layout = e.arch.kv_layout_name
        job = PrefillJob(
            f"req-{os.urandom(3).hex()}",
            prompt,
            {"temperature": 0.0},
            None,
            list(range(nblocks)),
            0,
            self.endpoint,
            os.getpid(),
            HOST,
            None,
            list(kv.shape),
            kv.element_size(),
            bs,
            model,
        )
        compat = {
            "model": model,
            "dtype": mc.dtype,
            "quantization": getattr(mc, "quantization", "none"),
            "block_size": bs,
            "kv_layers": kv.shape[0],
            "kv_planes": kv.shape[1],
            "kv_layout": kv_layout,
            "kv_heads": kv.shape[3],
            "head_dim": kv.shape[4],
            "kv_elem_size": kv.element_size(),
            "pdserve_version": pdserve.__version__,
        }
        return {
            **job.to_wire(),
            "transfer_id": os.urandom(8).hex(),
            "issued_at": time.time(),
            "max_model_len": 4096,
            "compat": compat,
            **changes,
        }

    def send(self, msg: dict[str, Any], key: bytes | None = None) -> None:
        self.push.send(pack(sign(msg, key)))

    def next_reply(self, timeout: float = 30.0) -> dict[str, Any]:
        return _recv(self.replies, timeout)

    def until(self, kinds: tuple[str, ...], timeout: float = 60.0) -> list[dict[str, Any]]:
        """Replies up to and including the first of `kinds`."""
        got: list[dict[str, Any]] = []
        while not got or got[-1]["type"] not in kinds:
            got.append(self.next_reply(timeout))
        return got

    def close(self) -> None:
        self.push.close(0)
        self.replies.close(0)


class PrefillPeer:
    """Receives a decode worker's jobs in place of a prefill worker and answers with whatever a
    test sends: control messages, and tcp layer headers with their KV frames."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.jobs = ctx.socket(zmq.PULL)
        self.jobs.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.jobs.bind_to_random_port('tcp://127.0.0.1')}"
        self.out: zmq.Socket | None = None

    def next_job(self, timeout: float = 30.0) -> dict[str, Any]:
        job = _recv(self.jobs, timeout)
        if self.out is None:
            self.out = zmq.Context.instance().socket(zmq.PUSH)
            self.out.setsockopt(zmq.LINGER, 0)
            self.out.connect(job["reply_endpoint"])
        return job

    def send(self, msg: dict[str, Any], key: bytes | None = None) -> None:
        self.out.send(pack(sign(msg, key)))

    def send_layer(
        self,
        request_id: str,
        transfer_id: str,
        runs: list[tuple[int, int]],
        frame_bytes: int,
        fill: int,
        key: bytes | None = None,
    ) -> None:
        """A tcp layer-0 write: per run of k blocks, a K and a V frame of `fill` bytes."""
        header = sign(
            {
                "type": PD_LAYER,
                "request_id": request_id,
                "transfer_id": transfer_id,
                "layer": 0,
                "runs": [list(r) for r in runs],
                "data": True,
            },
            key,
        )
        frames = [pack(header)] + [bytes([fill]) * frame_bytes * k for _, k in runs for _ in (0, 1)]
        self.out.send_multipart(frames)

    def close(self) -> None:
        for s in (self.jobs, self.out):
            if s is not None:
                s.close(0)
