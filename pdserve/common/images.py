"""Images in prompts, torch-free: data URLs, decoding with Pillow, the pixels a vision tower takes,
and where the images sit in a prompt.

An image occupies `tokens_per_image` positions of the prompt, each holding the model's image
token id; its embeddings replace those positions' token embeddings. The prefix cache names a
block by its token ids, which are the same for every image, so a block that overlaps an image
also hashes the image's digest (`block_extra`): a repeated image hits the cache, another misses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?)(?P<b64>;base64)?,", re.I)
_MIMES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
# What Pillow may open: the formats above. Any other plugin is never consulted (EPS would run
# Ghostscript where it is installed; each plugin is parser code a client could aim at).
PIL_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Wider or taller than this is refused: resizing the short edge to a tower's size would blow the
# long one up (a 1 x 10^6 image becomes 336 x 336 000 000 pixels).
MAX_ASPECT = 50
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image a request cannot use; the message says why (the API adds which part)."""


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The file bytes of a base64 `data:image/...` URL."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError("not a data: URL")
    mime = (m.group("mime") or "").lower()
    if mime not in _MIMES:
        raise ImageError(f"unsupported media type {mime or 'none'!r}; send image/png or image/jpeg")
    if not m.group("b64"):
        raise ImageError("the data: URL is not base64")
    body = url[m.end() :]
    if len(body) > (max_bytes + 2) // 3 * 4 + 4:  # refuse before decoding it
        raise ImageError(f"the image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"invalid base64 ({e})") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image is larger than {max_bytes} bytes")
    return data


def open_image(data: bytes, max_pixels: int) -> Any:
    """A fully decoded RGB PIL image; ImageError when Pillow cannot read it or it is too large."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
        if img.width * img.height > max_pixels:
            raise ImageError(
                f"the image has {img.width}x{img.height} pixels; at most {max_pixels} are allowed"
            )
        if max(img.width, img.height) > MAX_ASPECT * max(1, min(img.width, img.height)):
            raise ImageError(
                f"the image is {img.width}x{img.height}: sides more than {MAX_ASPECT} times apart"
            )
        img.load()
    except ImageError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"not a decodable image ({e})") from None
    return img.convert("RGB")


def image_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class ImageProcessing:
    """How an image becomes pixels (HF CLIPImageProcessor / SiglipImageProcessor): resize (the
    shortest edge, or to height x width), center crop, scale to [0, 1], normalize per channel."""

    shortest_edge: int | None = 336
    size: tuple[int, int] | None = None  # (height, width) when set, instead of shortest_edge
    crop: tuple[int, int] | None = (336, 336)
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    resample: int = 3  # PIL bicubic
    rescale: float = 1 / 255

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], image_size: int) -> ImageProcessing:
        size = cfg.get("size") or {"shortest_edge": image_size}
        crop = cfg.get("crop_size") if cfg.get("do_center_crop", "crop_size" in cfg) else None
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=size.get("shortest_edge") if isinstance(size, dict) else size,
            size=(size["height"], size["width"]) if isinstance(size, dict) and "height" in size else None,
            crop=(crop["height"], crop["width"]) if crop else None,
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
            std=tuple(cfg.get("image_std", CLIP_STD)),
            resample=cfg.get("resample", 3),
            rescale=cfg.get("rescale_factor", 1 / 255),
        )

    def pixels(self, img: Any) -> np.ndarray:
        """float32 [3, H, W] for an RGB PIL image."""
        import numpy as np  # not at import: the router's processes read data URLs without it

        if self.size is not None:
            img = img.resize((self.size[1], self.size[0]), self.resample)
        elif self.shortest_edge is not None:
            w, h = img.size
            s = self.shortest_edge
            nw, nh = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
            img = img.resize((nw, nh), self.resample)
        if self.crop is not None:
            ch, cw = self.crop
            w, h = img.size
            left, top = (w - cw) // 2, (h - ch) // 2
            img = img.crop((left, top, left + cw, top + ch))
        a = np.asarray(img, dtype=np.float32) * np.float32(self.rescale)
        out = (a - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(out.transpose(2, 0, 1), dtype=np.float32)


@dataclass(frozen=True)
class ImageSlots:
    """What the API needs to place a VLM's images in a prompt: the text standing for an image in the
    rendered chat (it tokenizes to `image_token_id`) and how many positions one image takes."""

    placeholder: str
    image_token_id: int
    tokens_per_image: int


@dataclass
class ImageInput:
    """One image of a prompt: positions [offset, offset + length) hold its embeddings."""

    offset: int
    length: int
    digest: bytes
    data: bytes  # the image file, as the client sent it
    embeds: Any = field(default=None, repr=False)  # [length, hidden] once encoded (engine side)

    def to_wire(self) -> dict[str, Any]:
        return {"offset": self.offset, "length": self.length, "digest": self.digest, "data": self.data}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ImageInput:
        return cls(int(d["offset"]), int(d["length"]), bytes(d["digest"]), bytes(d["data"]))

    def to_json(self) -> dict[str, Any]:
        """For the router's JSON request to a worker: digest in hex, file bytes in base64."""
        return {
            "offset": self.offset,
            "length": self.length,
            "digest": self.digest.hex(),
            "data": base64.b64encode(self.data).decode(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImageInput:
        """ValueError for a malformed one; the digest is computed again, never trusted."""
        try:
            data = base64.b64decode(d["data"], validate=True)
            return cls(int(d["offset"]), int(d["length"]), image_digest(data), data)
        except (KeyError, TypeError, binascii.Error) as e:
            raise ValueError(f"malformed image ({e})") from None


# Built-in test VLMs (model/vlm.py builds them): the router places their images without the model.
TINY_IMAGE_SLOTS = {"tiny-llava": ImageSlots("<empty_output>", 16, 16)}


def image_slots(model: str) -> ImageSlots | None:
    """How a model's prompts hold images, from its name or config.json alone (torch-free, for the
    router); None for a text-only model."""
    import json
    from pathlib import Path

    if model in TINY_IMAGE_SLOTS:
        return TINY_IMAGE_SLOTS[model]
    cfg_path = Path(model).expanduser() / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") != "llava" and "LlavaForConditionalGeneration" not in (
        cfg.get("architectures") or []
    ):
        return None
    vc = cfg.get("vision_config") or {}
    clip = "siglip" not in vc.get("model_type", "clip")
    patches = (vc.get("image_size", 336) // vc.get("patch_size", 14)) ** 2
    default = cfg.get("vision_feature_select_strategy", "default") == "default"
    token = int(cfg.get("image_token_index", cfg.get("image_token_id", 32000)))
    return ImageSlots(_token_text(cfg_path.parent, token), token, patches + int(clip) - int(default))


def _token_text(model_dir: Any, token_id: int) -> str:
    """The text of the image token (an added token of tokenizer.json), `<image>` by default."""
    import json

    path = model_dir / "tokenizer.json"
    if path.is_file():
        for t in json.loads(path.read_text()).get("added_tokens") or []:
            if t.get("id") == token_id and t.get("content"):
                return str(t["content"])
    return "<image>"


def block_extra(images: list[ImageInput], start: int, end: int) -> bytes | None:
    """The digests of the images overlapping prompt positions [start, end) (a block), or None."""
    out = [im.digest for im in images if im.offset < end and im.offset + im.length > start]
    return b"".join(out) or None


def expand_image_tokens(
    ids: list[int], image_token_id: int, tokens_per_image: int, images: list[tuple[bytes, bytes]]
) -> tuple[list[int], list[ImageInput]]:
    """Each image token of a tokenized prompt becomes `tokens_per_image` of them; `images` are
    (digest, data) in prompt order. ImageError when the counts differ (text that spells the image
    token itself)."""
    found = ids.count(image_token_id)
    if found != len(images):
        raise ImageError(
            f"the prompt holds {found} image tokens for {len(images)} images; the text must not "
            "contain the model's image token"
        )
    out: list[int] = []
    placed: list[ImageInput] = []
    for t in ids:
        if t == image_token_id:
            digest, data = images[len(placed)]
            placed.append(ImageInput(len(out), tokens_per_image, digest, data))
            out.extend([image_token_id] * tokens_per_image)
        else:
            out.append(t)
    return out, placed
