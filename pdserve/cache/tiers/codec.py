"""One KV block <-> bytes, for the disk and remote tiers. Never pickle: these bytes cross machines.

Layout (little-endian):
    magic "PDKV" | version u16 | dtype u8 | ndim u8 | shape u32*ndim | hash_len u8 | hash |
    payload_len u64 | checksum (blake2b-128 of everything before it, then of the payload) | payload
The checksum covers the header too, so a flipped bit anywhere is caught; the block hash inside
catches a file that was renamed or a key that was overwritten with another block's bytes. With a key
(derived from the internal token) the checksum is a MAC: whoever can write to the disk or Redis but
lacks the token cannot plant a block that workers would load.
"""

from __future__ import annotations

import hashlib
import struct

import torch

MAGIC = b"PDKV"
VERSION = 1
_CHECKSUM_LEN = 16
_FIXED = struct.Struct("<4sHBB")  # magic, version, dtype code, ndim

# Codes are part of the format: append only.
_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.int8,
    6: torch.uint8,
    7: torch.float8_e4m3fn,
    8: torch.float8_e5m2,
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


class CorruptBlock(ValueError):
    """The bytes are not a valid encoding of the block that was asked for."""


def _checksum(header: bytes, payload: memoryview | bytes, key: bytes | None) -> bytes:
    h = hashlib.blake2b(header, digest_size=_CHECKSUM_LEN, key=key or b"")
    h.update(payload)
    return h.digest()


def encode_block(block_hash: bytes, block: torch.Tensor, key: bytes | None = None) -> bytes:
    """`block` is one block's KV, [layers, 2, block_size, kv_heads, head_dim], on any device."""
    if block.dtype not in _CODES:
        raise ValueError(f"unsupported KV dtype {block.dtype}")
    if not 0 < len(block_hash) < 256:
        raise ValueError("the block hash must be 1..255 bytes")
    data = block.detach().to("cpu").contiguous()
    payload = data.reshape(-1).view(torch.uint8).numpy()
    header = (
        _FIXED.pack(MAGIC, VERSION, _CODES[block.dtype], data.dim())
        + struct.pack(f"<{data.dim()}I", *data.shape)
        + struct.pack("<B", len(block_hash))
        + block_hash
        + struct.pack("<Q", payload.nbytes)
    )
    return b"".join((header, _checksum(header, payload, key), payload.tobytes()))


def decode_block(
    data: bytes | bytearray | memoryview,
    expected_hash: bytes | None = None,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    key: bytes | None = None,
) -> torch.Tensor:
    """The block's tensor (CPU). Raises CorruptBlock on any mismatch; checks shape/dtype when given."""
    view = memoryview(data)
    try:
        magic, version, code, ndim = _FIXED.unpack_from(view, 0)
        pos = _FIXED.size
        if magic != MAGIC:
            raise CorruptBlock("bad magic")
        if version != VERSION:
            raise CorruptBlock(f"unsupported version {version}")
        if code not in _DTYPES:
            raise CorruptBlock(f"unknown dtype code {code}")
        got_shape = struct.unpack_from(f"<{ndim}I", view, pos)
        pos += 4 * ndim
        (hash_len,) = struct.unpack_from("<B", view, pos)
        pos += 1
        got_hash = bytes(view[pos : pos + hash_len])
        pos += hash_len
        (payload_len,) = struct.unpack_from("<Q", view, pos)
        pos += 8
    except struct.error as e:
        raise CorruptBlock(f"truncated header: {e}") from None
    got_dtype = _DTYPES[code]
    if len(got_hash) != hash_len:
        raise CorruptBlock("truncated header")
    if expected_hash is not None and got_hash != expected_hash:
        raise CorruptBlock("the block hash does not match")
    numel = 1
    for d in got_shape:
        numel *= d
    elem = torch.empty((), dtype=got_dtype).element_size()
    if payload_len != numel * elem:
        raise CorruptBlock("the payload length does not match the shape")
    if len(view) != pos + _CHECKSUM_LEN + payload_len:
        raise CorruptBlock(f"length {len(view)}, expected {pos + _CHECKSUM_LEN + payload_len}")
    payload = view[pos + _CHECKSUM_LEN :]
    if bytes(view[pos : pos + _CHECKSUM_LEN]) != _checksum(bytes(view[:pos]), payload, key):
        raise CorruptBlock("bad checksum")
    if shape is not None and tuple(got_shape) != tuple(shape):
        raise CorruptBlock(f"shape {tuple(got_shape)}, expected {tuple(shape)}")
    if dtype is not None and got_dtype != dtype:
        raise CorruptBlock(f"dtype {got_dtype}, expected {dtype}")
    # A private writable copy: torch.frombuffer warns on read-only buffers, and the caller owns it.
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(got_dtype).reshape(got_shape) if numel else torch.empty(got_shape, dtype=got_dtype)
