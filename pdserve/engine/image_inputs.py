"""Image embeddings for the engine: each request's images are encoded before its image positions
are computed here, by the vision tower in this process or by encoder workers (encoder_pool.py).

The scheduler asks `ready(req)` before it computes a waiting request locally, with the prefix
cache's hit already counted: images entirely inside cached blocks are never encoded again (a
repeated image is a cache hit), the others are submitted once and the request waits until all
have arrived. A request sent to a prefill worker is never encoded here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdserve.common.errors import InvalidParam
from pdserve.common.images import ImageError, ImageInput, ImageSlots, open_image
from pdserve.config import Config, VisionConfig
from pdserve.engine.request import Request

log = logging.getLogger(__name__)


def check_images(
    images: list[ImageInput], prompt: list[int], image_token_id: int, tokens_per_image: int
) -> None:
    """InvalidParam unless each image covers `tokens_per_image` image tokens of the prompt, in order,
    and no other position holds the image token."""
    covered = 0
    last = 0
    for im in images:
        if im.length != tokens_per_image or im.offset < last or im.offset + im.length > len(prompt):
            raise InvalidParam("an image's positions do not fit the prompt", "images")
        if any(t != image_token_id for t in prompt[im.offset : im.offset + im.length]):
            raise InvalidParam("an image's positions do not hold the image token", "images")
        covered += im.length
        last = im.offset + im.length
    if prompt.count(image_token_id) != covered:
        raise InvalidParam("the prompt holds image tokens without an image", "images")


def image_embeddings(bundle: Any, config: Config) -> ImageEmbeddings:
    """In this process, or through encoder workers when vision.encoder_endpoints/processes say so."""
    from pdserve.model.loader import torch_dtype

    vc, mc = config.vision, config.model
    pool = None
    if vc.encoder_endpoints or vc.encoder_processes:
        from pdserve.engine.encoder_pool import EncoderPool

        spec = bundle.spec
        pool = EncoderPool.from_config(config, (spec.tokens_per_image, spec.text_hidden_size))
    return ImageEmbeddings(bundle, vc, torch_dtype(mc.dtype), mc.device, pool)


class ImageEmbeddings:
    """`encode(images) -> [n, tokens, hidden]` runs in this process; `pool` (encoder workers) is
    asynchronous: its answers arrive in `poll`."""

    def __init__(
        self, bundle: Any, config: VisionConfig, dtype: torch.dtype, device: str, pool: Any = None
    ) -> None:
        self.bundle = bundle
        self.spec = bundle.spec
        self.slots = ImageSlots(bundle.placeholder, self.spec.image_token_id, self.spec.tokens_per_image)
        self.config = config
        self.pool = pool
        self.encoder = bundle.encoder(dtype, device) if pool is None else None
        self.pending: dict[str, tuple[Request, list[ImageInput]]] = {}  # request id -> images asked for
        self.failed: list[tuple[str, str]] = []  # (request id, why) to end with an error
        self.images_encoded_total = 0

    def check(self, images: list[ImageInput], prompt: list[int]) -> None:
        check_images(images, prompt, self.spec.image_token_id, self.spec.tokens_per_image)

    def pixels(self, im: ImageInput) -> torch.Tensor:
        return torch.from_numpy(
            self.bundle.processing.pixels(open_image(im.data, self.config.max_image_pixels))
        )

    def ready(self, req: Request) -> bool:
        """True when every image at or after req.num_computed_tokens has its embeddings."""
        missing = [
            im for im in req.images if im.embeds is None and im.offset + im.length > req.num_computed_tokens
        ]
        if not missing:
            return True
        if req.request_id in self.pending:
            return False
        if self.pool is not None:
            self.pending[req.request_id] = (req, missing)
            self.pool.submit(req.request_id, missing)
            return False
        try:
            embeds = self.encoder(torch.stack([self.pixels(im) for im in missing]))  # type: ignore[misc]
        except ImageError as e:
            self.failed.append((req.request_id, str(e)))
            return False
        for im, rows in zip(missing, embeds):
            im.embeds = rows
        self.images_encoded_total += len(missing)
        return True

    def poll(self) -> None:
        """Take the encoder workers' answers (engine thread)."""
        if self.pool is None:
            return
        for rid, result in self.pool.poll():
            req, images = self.pending.pop(rid, (None, []))
            if req is None:
                continue
            if isinstance(result, str):
                self.failed.append((rid, result))
                continue
            for im, arr in zip(images, result):
                im.embeds = torch.from_numpy(np.asarray(arr))
            self.images_encoded_total += len(images)

    def drop(self, request_id: str) -> None:
        """The request ended (aborted, finished): an answer still to come is dropped."""
        if self.pending.pop(request_id, None) is not None and self.pool is not None:
            self.pool.cancel(request_id)

    def take_failed(self) -> list[tuple[str, str]]:
        out, self.failed = self.failed, []
        return out

    def has_work(self) -> bool:
        return bool(self.pending)

    def wait(self, timeout: float, wake: Callable[[], None] | None = None) -> None:
        if self.pool is not None:
            self.pool.wait(timeout)

    def stats(self) -> dict[str, float]:
        return {
            "images_encoded_total": self.images_encoded_total,
            "images_pending": len(self.pending),
            **(self.pool.stats() if self.pool is not None else {}),
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
