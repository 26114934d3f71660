"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

gguf.GGUFReader builds a numpy view for every part of every metadata value: for a vocabulary of
49,152 tokens and as many merges that was most of a worker's start, before any weight was read. Here a
value is parsed with struct straight into Python objects (a string array is a loop over
length-prefixed bytes), and a tensor is one numpy view of the mapped file, shaped as GGUFReader
shapes it (quantized types as rows of bytes), so gguf.quants and the loaders take it unchanged.
Metadata alone needs no numpy (the router reads a tokenizer from here on a cache miss).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian files, versions
2 and 3)."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types: struct format of the scalars, 8 a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: the fastest-moving dimension first
    type_id: int
    offset: int  # from the start of the data section


class GGUFFile:
    """`fields`: metadata as plain Python values (str, int, float, bool, lists of them; with
    `arrays=False` an array is its length, for readers of the header alone).
    `tensor_infos`: the tensor table in file order; `tensors()` maps them (numpy imported then)."""

    def __init__(self, path: str | Path, arrays: bool = True) -> None:
        self.path, self._arrays = str(path), arrays
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        self._pos = 4
        self.version, n_tensors, n_kv = self._unpack("<IQQ")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} (2 and 3 are read)")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        self.tensor_infos: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            type_id, offset = self._unpack("<IQ")
            self.tensor_infos.append(TensorInfo(name, tuple(dims), type_id, offset))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-self._pos // align) * align

    def close(self) -> None:
        """Unmap the file (numpy views from `tensors()` keep it mapped while they live)."""
        try:
            self._map.close()
        except BufferError:
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unpack(self, fmt: str) -> tuple:
        end = self._pos + struct.calcsize(fmt)
        if end > len(self._map):
            raise GGUFFormatError(f"{self.path}: the header runs past the end of the file")
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos = end
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        start = self._pos
        self._pos = start + n
        if self._pos > len(self._map):
            raise GGUFFormatError(f"{self.path}: a string runs past the end of the file")
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path}: metadata value type {vtype} is unknown")
        itype, count = self._unpack("<IQ")
        if not self._arrays:  # its length only, its items skipped
            if itype in _SCALARS:
                self._pos += count * struct.calcsize(_SCALARS[itype])
            else:
                for _ in range(count):
                    if itype == _STRING:  # not decoded
                        (n,) = self._unpack("<Q")
                        self._pos += n
                    else:
                        self._value(itype)
            return count
        if itype == _STRING:
            return [self._string() for _ in range(count)]
        if itype in _SCALARS:
            return list(self._unpack(f"<{count}{_SCALARS[itype]}"))
        return [self._value(itype) for _ in range(count)]  # arrays of arrays

    def tensors(self) -> list[Tensor]:
        """Every tensor as a read-only numpy view of the file: float types (F32, F16, F64, I8-I64)
        in their own dtype and numpy's order (the ggml dims reversed); the others (quantized, BF16)
        as uint8 rows of their stored bytes, as gguf.GGUFReader gives them."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        plain = {
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.F64: np.float64,
            GGMLQuantizationType.I8: np.int8,
            GGMLQuantizationType.I16: np.int16,
            GGMLQuantizationType.I32: np.int32,
            GGMLQuantizationType.I64: np.int64,
        }
        data = np.frombuffer(self._map, dtype=np.uint8)
        out = []
        for t in self.tensor_infos:
            kind = GGMLQuantizationType(t.type_id)
            block, type_size = GGML_QUANT_SIZES[kind]
            shape = tuple(reversed(t.dims))
            if t.dims and t.dims[0] % block:
                raise GGUFFormatError(f"{self.path}: {t.name}'s rows are not whole {kind.name} blocks")
            n_bytes = math.prod(t.dims) // block * type_size
            start = self.data_offset + t.offset
            if start + n_bytes > len(self._map):
                raise GGUFFormatError(f"{self.path}: tensor {t.name} runs past the end of the file")
            raw = data[start : start + n_bytes]
            if kind in plain:
                arr = raw.view(plain[kind]).reshape(shape)
            else:
                arr = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            out.append(Tensor(t.name, kind, t.dims, arr))
        return out


@dataclass
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order, as gguf.ReaderTensor.shape
    data: Any  # numpy array, a view of the mapped file
