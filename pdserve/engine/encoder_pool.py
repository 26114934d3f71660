"""The engine's side of the encoder workers (encoder_worker.py): sends each request's images to
the least loaded encoder, takes the embeddings back, and gives up on a job past its deadline.

Used from the engine thread only (image_inputs.ImageEmbeddings): `submit`, then `poll` each step.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from pdserve.common.images import ImageInput
from pdserve.config import Config
from pdserve.engine.encoder_worker import EMBEDS, ENCODE, encoder_key, run_encoder
from pdserve.protocol import pack, unpack
from pdserve.utils.signing import CONTROL_BYTES, sign, verified

log = logging.getLogger(__name__)


def pick_encoder(outstanding: list[int], last: int) -> int:
    """The encoder with the fewest images in flight; ties go round-robin after `last`."""
    n = len(outstanding)
    return min(range(n), key=lambda i: (outstanding[i], (i - last - 1) % n))


@dataclass
class _Job:
    request_id: str
    encoder: int
    images: int
    deadline: float


class EncoderPool:
    def __init__(
        self,
        endpoints: list[str],
        timeout_s: float,
        processes: list[Any] | None = None,
        key: bytes | None = None,
        shape: tuple[int, int] = (0, 0),
        max_images: int = 0,
    ) -> None:
        """`shape`: (tokens, hidden) of one image's embeddings, which an answer must have (and
        `max_images` of them at most bound the size of a frame an encoder may send)."""
        if not endpoints:
            raise ValueError("an encoder pool needs at least one encoder")
        self.endpoints = endpoints
        self.shape = tuple(shape)
        self.timeout_s = timeout_s
        self.key = key  # HMAC of jobs and answers (encoder_worker.encoder_key)
        self.processes = processes or []  # encoder processes this pool spawned (ends them on close)
        ctx: zmq.Context = zmq.Context.instance()
        self.socks = []
        self.poller = zmq.Poller()
        for ep in endpoints:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if self.shape[0] and max_images:  # one image's float32 rows per frame, the map around them
                s.setsockopt(zmq.MAXMSGSIZE, max_images * self.shape[0] * self.shape[1] * 4 + CONTROL_BYTES)
            s.connect(ep)
            self.socks.append(s)
            self.poller.register(s, zmq.POLLIN)
        self.outstanding = [0] * len(endpoints)  # images in flight per encoder
        self.jobs: dict[str, _Job] = {}  # job id -> job
        self.by_request: dict[str, str] = {}  # request id -> job id
        self.last = -1
        self.jobs_total = 0
        self.failures_total = 0

    @classmethod
    def from_config(cls, config: Config, shape: tuple[int, int] = (0, 0)) -> EncoderPool:
        """Remote encoders (vision.encoder_endpoints), else vision.encoder_processes spawned here;
        `shape`: (tokens, hidden) of one image's embeddings."""
        vc = config.vision
        key = encoder_key(config)
        if vc.encoder_endpoints:
            return cls(
                list(vc.encoder_endpoints),
                vc.encode_timeout_s,
                key=key,
                shape=shape,
                max_images=vc.max_images,
            )
        mc = config.model
        overrides = {
            "model.name": mc.name,
            "model.seed": mc.seed,
            "model.dtype": mc.dtype,
            "model.device": mc.device,
            "server.threads": config.server.threads or 1,
            "vision.max_image_pixels": vc.max_image_pixels,
            "server.internal_token": config.server.internal_token,
        }
        ctx = multiprocessing.get_context("spawn")
        endpoints, procs = [], []
        for i in range(vc.encoder_processes):
            ep = f"ipc://{tempfile.gettempdir()}/pdserve-enc-{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}"
            p = ctx.Process(
                target=run_encoder, args=(overrides, ep), name=f"pdserve-encoder-{i}", daemon=True
            )
            p.start()
            endpoints.append(ep)
            procs.append(p)
        return cls(endpoints, vc.encode_timeout_s, procs, key, shape, vc.max_images)

    def submit(self, request_id: str, images: list[ImageInput]) -> None:
        i = pick_encoder(self.outstanding, self.last)
        self.last = i
        job = uuid.uuid4().hex
        self.jobs[job] = _Job(request_id, i, len(images), time.monotonic() + self.timeout_s)
        self.by_request[request_id] = job
        self.outstanding[i] += len(images)
        self.jobs_total += 1
        self.socks[i].send(
            pack(sign({"type": ENCODE, "job": job, "images": [im.data for im in images]}, self.key))
        )

    def _end(self, job_id: str) -> _Job | None:
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self.outstanding[job.encoder] -= job.images
            if self.by_request.get(job.request_id) == job_id:
                del self.by_request[job.request_id]
        return job

    def cancel(self, request_id: str) -> None:
        """Drop the request's job; its answer, if it comes, is ignored."""
        job = self.by_request.get(request_id)
        if job is not None:
            self._end(job)

    def poll(self) -> list[tuple[str, list[np.ndarray] | str]]:
        """(request id, embeddings per image or why it failed) for every job that ended."""
        out: list[tuple[str, list[np.ndarray] | str]] = []
        for sock in self.socks:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = unpack(frames[0])
                except ValueError:
                    log.warning("encoder sent a malformed message")
                    continue
                if not verified(msg, self.key):
                    log.warning("dropped an encoder answer not signed with the internal token")
                    continue
                job = self._end(str(msg.get("job"))) if msg.get("type") == EMBEDS else None
                if job is None:
                    continue  # cancelled, timed out, or not ours
                result = self._embeddings(msg, job)
                if isinstance(result, str):
                    self.failures_total += 1
                out.append((job.request_id, result))
        now = time.monotonic()
        for job_id, job in list(self.jobs.items()):
            if now > job.deadline:
                self._end(job_id)
                self.failures_total += 1
                out.append(
                    (
                        job.request_id,
                        f"no answer from encoder {self.endpoints[job.encoder]} within "
                        f"{self.timeout_s:g} s (vision.encode_timeout_s)",
                    )
                )
        return out

    def _embeddings(self, msg: dict[str, Any], job: _Job) -> list[np.ndarray] | str:
        """An answer's embeddings, or why they are unusable: its values reach the engine thread, so
        their count, shape, size and finiteness are checked here (the answer is signed, not right)."""
        embeds = msg.get("embeds")
        if msg.get("error") is not None:
            return str(msg["error"])[:1000]
        if not isinstance(embeds, list) or len(embeds) != job.images:
            return "the encoder answered the wrong image count"
        shape = msg.get("shape")
        if self.shape[0] and shape != list(self.shape):
            return f"the encoder answered embeddings of shape {str(shape)[:100]}, not {list(self.shape)}"
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(x) is int and x > 0 for x in shape)):
            return "the encoder answered a malformed shape"
        if msg.get("dtype", "float32") != "float32" or not all(
            isinstance(e, bytes) and len(e) == shape[0] * shape[1] * 4 for e in embeds
        ):
            return "the encoder answered embeddings of the wrong size or type"
        arrays = [np.frombuffer(e, np.float32).reshape(shape).copy() for e in embeds]
        if not all(np.isfinite(a).all() for a in arrays):
            return "the encoder answered non-finite embeddings"
        return arrays

    def wait(self, timeout: float) -> None:
        self.poller.poll(int(timeout * 1000))

    def stats(self) -> dict[str, float]:
        return {
            "encoder_jobs_total": self.jobs_total,
            "encoder_failures_total": self.failures_total,
            "encoder_images_in_flight": sum(self.outstanding),
        }

    def close(self) -> None:
        for s in self.socks:
            s.close()
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            p.join(timeout=5)
        # The encoders this pool spawned exit at once on SIGTERM: their sockets' files would stay.
        if self.processes:
            for ep in self.endpoints:
                if ep.startswith("ipc://"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(ep[len("ipc://") :])
