"""Small test images as data: URLs and chat messages for the VLM tests. (pytest puts tests/ on the path.)"""

from __future__ import annotations

import base64
import io

import numpy as np


def image_bytes(seed: int, fmt: str = "PNG", size: tuple[int, int] = (40, 48)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(*seeds: int, text: str = "What is in the picture? Tell me.", fmt: str = "PNG") -> list[dict]:
    mime = "image/png" if fmt == "PNG" else "image/jpeg"
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(image_bytes(s, fmt), mime)}} for s in seeds]
    return [{"role": "user", "content": parts}]
