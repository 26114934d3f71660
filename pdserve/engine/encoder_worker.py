"""An encoder worker: a process holding a VLM's vision tower and projector (not its decoder),
answering encode jobs from engines over ZeroMQ (`pdserve encoder`, or spawned by an engine for
vision.encoder_processes).

Wire (one msgpack map with a "type" per message, nothing pickled; encoder_pool.py is the other end):
  engine -> encoder (DEALER -> ROUTER): {"type": "encode", "job", "images": [file bytes, ...]}
  encoder -> engine: {"type": "embeds", "job", "shape": [tokens, hidden], "dtype": "float32",
                      "embeds": [raw float32 bytes per image], "error": None or why}
With an internal token (server.internal_token or PDSERVE_INTERNAL_TOKEN) both directions carry the
KV plane's HMAC (disagg/trust.py): an encoder answers only signed jobs (an unsigned one gets no
answer at all) and an engine takes only signed embeddings, which the prefix cache would otherwise
keep under the image's digest. Neither socket takes a frame larger than a legitimate message.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import numpy as np
import torch
import zmq

from pdserve.common.images import ImageError, open_image
from pdserve.config import Config
from pdserve.protocol import pack, unpack
from pdserve.utils.signing import CONTROL_BYTES, sign, token_key, verified

log = logging.getLogger(__name__)
ENCODE, EMBEDS = "encode", "embeds"


def encoder_key(config: Config) -> bytes | None:
    """The HMAC key of encode jobs and answers: the deployment's internal token, if any."""
    return token_key(config.server.internal_token or os.environ.get("PDSERVE_INTERNAL_TOKEN") or None)


class EncoderWorker:
    def __init__(self, config: Config) -> None:
        from pdserve.model.loader import torch_dtype
        from pdserve.model.vlm import load_vision

        mc = config.model
        if config.server.threads:
            torch.set_num_threads(config.server.threads)
        bundle = load_vision(mc.name, mc.seed)  # the decoder's weights are not read
        if bundle is None:
            raise ValueError(f"the model {mc.name!r} has no vision tower to serve")
        self.bundle = bundle
        self.encoder = bundle.encoder(torch_dtype(mc.dtype), mc.device)
        self.max_pixels = config.vision.max_image_pixels
        self.max_job_bytes = config.vision.max_images * config.vision.max_image_bytes + CONTROL_BYTES
        self.key = encoder_key(config)
        self.jobs_total = 0
        self.rejected_total = 0

    def encode(self, images: list[bytes]) -> np.ndarray:
        """[images, tokens, hidden] float32; ImageError for an image that cannot be read."""
        pixels = torch.stack(
            [torch.from_numpy(self.bundle.processing.pixels(open_image(d, self.max_pixels))) for d in images]
        )
        return self.encoder(pixels).float().cpu().numpy()

    def answer(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The reply to one request message; None for one not signed with the internal token, which
        is never answered (nor encoded)."""
        job = msg.get("job")
        if not verified(msg, self.key):
            self.rejected_total += 1
            log.log(
                logging.ERROR if self.rejected_total == 1 else logging.DEBUG,
                "ignoring an encode job not signed with the internal token (server.internal_token)",
            )
            return None
        if msg.get("type") != ENCODE or not isinstance(msg.get("images"), list):
            return {"type": EMBEDS, "job": job, "error": f"unknown message {msg.get('type')!r}"}
        try:
            out = self.encode([bytes(d) for d in msg["images"]])
        except (ImageError, ValueError, RuntimeError) as e:
            return {"type": EMBEDS, "job": job, "error": str(e)}
        self.jobs_total += 1
        return {
            "type": EMBEDS,
            "job": job,
            "shape": list(out.shape[1:]),
            "dtype": "float32",
            "error": None,
            "embeds": [np.ascontiguousarray(e).tobytes() for e in out],
        }

    def serve(self, endpoint: str, stop: Any = None) -> None:
        """Answer jobs on `endpoint` (bound here) until SIGTERM or `stop()` is true."""
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(
            zmq.MAXMSGSIZE, self.max_job_bytes
        )  # no more than max_images images of max_image_bytes
        sock.bind(endpoint)
        log.info("encoder worker for %s on %s", self.bundle.spec.kind, endpoint)
        try:
            while not (stop and stop()):
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                ident, body = frames[0], frames[-1]
                try:
                    msg = unpack(body)
                except Exception as e:  # noqa: BLE001 - a malformed message is answered, not fatal
                    msg = {"type": f"malformed ({e})"}
                reply = self.answer(msg)
                if reply is not None:
                    sock.send_multipart([ident, pack(sign(reply, self.key))])
        finally:
            sock.close()


def run_encoder(overrides: dict[str, Any], endpoint: str) -> None:
    """Entry of a spawned encoder process (encoder_pool.py), configured by dotted `overrides`;
    dies with its engine."""
    from pdserve.config import load_config
    from pdserve.utils.process import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    EncoderWorker(load_config(None, overrides)).serve(endpoint)
