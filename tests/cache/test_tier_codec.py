"""Block codec: exact round trips, and every kind of damage is refused with CorruptBlock."""

from __future__ import annotations

import struct

import pytest
import torch

from pdserve.cache.tiers.codec import CorruptBlock, decode_block, encode_block

H = bytes(range(16))
SHAPE = (3, 2, 4, 2, 8)  # layers, k/v, block_size, kv_heads, head_dim


def _block(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn]
)
def test_round_trip_is_bit_exact(dtype):
    block = _block(dtype)
    out = decode_block(encode_block(H, block), H, shape=SHAPE, dtype=dtype)
    assert out.dtype == dtype and tuple(out.shape) == SHAPE
    assert _raw(out) == _raw(block)


def test_encodes_a_strided_slice_of_the_kv_tensor():
    bs = 4
    kv = torch.randn(3, 2, 5 * bs, 2, 8)
    view = kv[:, :, 2 * bs : 3 * bs]  # not contiguous: how the tiers see a block
    assert not view.is_contiguous()
    out = decode_block(encode_block(H, view), H)
    assert _raw(out) == _raw(view.contiguous())


def test_decoded_tensor_is_private_and_writable():
    data = encode_block(H, _block(torch.float32))
    out = decode_block(data, H)
    out.zero_()  # must not touch `data`
    assert _raw(decode_block(data, H)) == _raw(_block(torch.float32))


def _expect_corrupt(data, **kw):
    with pytest.raises(CorruptBlock):
        decode_block(data, kw.pop("expected_hash", H), **kw)


def test_rejects_wrong_hash_shape_and_dtype():
    data = encode_block(H, _block(torch.float32))
    _expect_corrupt(data, expected_hash=bytes(16))
    _expect_corrupt(data, shape=(3, 2, 8, 2, 4))
    _expect_corrupt(data, dtype=torch.float16)
    assert decode_block(data) is not None  # nothing to compare against: accepted


def test_rejects_any_flipped_bit():
    data = encode_block(H, _block(torch.float32))
    # Every header byte and a spread of payload bytes, one at a time.
    for pos in [*range(60), *range(60, len(data), 97), len(data) - 1]:
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        _expect_corrupt(bytes(damaged))


def test_rejects_truncated_and_padded_data():
    data = encode_block(H, _block(torch.float32))
    for cut in (0, 3, 4, 8, 20, 40, 60, len(data) // 2, len(data) - 1):
        _expect_corrupt(data[:cut])
    _expect_corrupt(data + b"\0")


def test_rejects_bad_magic_version_and_dtype_code():
    data = bytearray(encode_block(H, _block(torch.float32)))
    for offset, value in ((0, b"XXXX"), (4, struct.pack("<H", 99)), (6, bytes([250]))):
        damaged = bytearray(data)
        damaged[offset : offset + len(value)] = value
        _expect_corrupt(bytes(damaged))


def test_encode_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError):
        encode_block(H, torch.zeros(SHAPE, dtype=torch.complex64))
    with pytest.raises(ValueError):
        encode_block(b"", _block(torch.float32))
