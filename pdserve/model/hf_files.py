"""Reading a Hugging Face model directory's weights, one tensor at a time.

`HFWeights` maps HF names to tensors read from the *.safetensors files when asked for, each in its
stored dtype or converted to one dtype as it is read. Nothing is cached: a model built from it keeps
only its own (converted, fused, quantized) copy of each weight, so the resident set while loading
stays near the final one (docs/models.md). A tensor's bytes are read from the file straight into its
tensor, at the offsets the file's header gives: no mapping of the file (safetensors' own reader maps
it, and the mapped pages of the tensor being copied count in the resident set on top of the copy,
one tensor's size more at the peak), and no copy beside the tensor. The heap is trimmed before each
read: the freed scratch of converting and packing the previous weights would otherwise pile up
(pdserve keeps freed memory for the steps' buffers, utils/runtime.py).

FP8 weights (`float8_e4m3fn`, also `float8_e5m2`) come with block scales as DeepSeek-V3 and others
store them: `<name>_scale_inv`, float32 [ceil(N/bn), ceil(K/bk)], and w[n, k] = q[n, k] *
scale_inv[n // bn, k // bk], with (bn, bk) config.json's `quantization_config.weight_block_size`
(128x128 when absent). Where N or K is not a multiple of the block, the last blocks are partial.
They are dequantized as they are read (in float32, then to the target dtype), a bounded number of
rows at a time.

A MoE layer's experts stacked in one 3-D tensor (transformers 5's fused `gate_up_proj`) are read one
expert at a time (`read_index`). The KV tiers' weight digest (`digest`) samples each tensor's stored
bytes as the tensor is read for the build, so that start-up reads the files once; a tensor the build
never read whole is sampled from its file, a few elements.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.model.quant import Staged, can_quantize, quantize
from pdserve.utils.runtime import trim_heap

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
# Elements dequantized at once: bounds the float32 scratch of one FP8 tensor (64 MB).
_CHUNK = 1 << 24
# A safetensors header larger than this is not one (the format's own reader caps it at 100 MB).
_MAX_HEADER = 100 << 20
# Bytes of a large matrix read at once where it is quantized as it is read (`HFWeights.quantized`).
_ROWS_READ = 16 << 20
# Elements of each tensor the weight digest reads: any two different checkpoints (a fine-tune changes
# every matrix) differ there.
DIGEST_SAMPLES = 257

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies and what it is, from its file's header (no data read)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one .safetensors file, from its JSON header alone."""
    with open(file, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise ValueError(f"{file}: not a safetensors file")
        meta = json.loads(f.read(size))
        data = f.seek(0, 2) - 8 - size  # bytes after the header
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, which pdserve does not read")
        start, end = info["data_offsets"]
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= start <= end <= data or end - start != numel * dtype.itemsize:
            raise ValueError(
                f"{file}: tensor {name} has offsets {start}-{end} that do not fit its shape or the file"
            )
        out[name] = StoredTensor(file, dtype, shape, 8 + size + start, end - start)
    return out


def fp8_block_size(cfg: dict[str, Any]) -> tuple[int, int]:
    """The FP8 block (rows, columns) of a config.json. A checkpoint quantized some other way (GPTQ,
    AWQ, bitsandbytes, compressed-tensors) stores packed integers pdserve would misread: refused."""
    qc = cfg.get("quantization_config")
    if not qc:
        return DEFAULT_BLOCK
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"config.json: quantization_config.quant_method {method!r} is not supported; pdserve loads "
            "float (F32, BF16, F16) and FP8 block-scaled (quant_method fp8) checkpoints"
        )
    block = qc.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size {block!r} is not [rows, columns]"
        )
    return int(block[0]), int(block[1])


def dequantize_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w = q * scale_inv over blocks of `block` (the last ones partial), in `dtype`. The product is taken
    in float32, which holds it to one rounding (an FP8 value has 4 significant bits)."""
    s = scale_inv.float()
    if q.dim() == 3 and s.dim() == 3 and s.shape[0] == q.shape[0]:  # stacked experts, a grid each
        out3 = torch.empty(q.shape, dtype=dtype)
        for i in range(q.shape[0]):
            out3[i] = dequantize_fp8(q[i], s[i], block, dtype)
        return out3
    if q.dim() != 2:
        if s.numel() != 1:
            raise ValueError(f"an FP8 tensor of shape {tuple(q.shape)} needs one scale, got {tuple(s.shape)}")
        return (q.float() * s.reshape(())).to(dtype)
    n, k = q.shape
    bn, bk = block
    grid = (-(-n // bn), -(-k // bk))
    if s.numel() == 1:  # one scale for the whole tensor
        s = s.reshape(1, 1).expand(grid)
    if tuple(s.shape) != grid:
        raise ValueError(
            f"FP8 scales of shape {tuple(s.shape)} do not tile a [{n}, {k}] weight in {bn}x{bk} blocks "
            f"(expected {list(grid)}); check quantization_config.weight_block_size"
        )
    out = torch.empty(n, k, dtype=dtype)
    whole = k - k % bk  # columns in whole blocks; the rest is one partial block
    step = max(1, _CHUNK // max(k * bn, 1)) * bn  # rows a pass, whole blocks of them
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        x = q[r0:r1].float()
        rs = s[r0 // bn : -(-r1 // bn)].repeat_interleave(bn, 0)[: r1 - r0]  # [rows, K blocks]
        if whole:
            x[:, :whole].unflatten(1, (whole // bk, bk)).mul_(rs[:, : whole // bk, None])
        if whole < k:
            x[:, whole:].mul_(rs[:, -1:])
        out[r0:r1] = x
    return out


class HFWeights(Mapping[str, torch.Tensor]):
    """The tensors of a Hugging Face directory by HF name, read on each access (see the module docstring).

    `dtype` None: floating tensors as stored, FP8 ones dequantized to float32; else every floating
    tensor converted to `dtype` as it is read. Integer tensors stay as stored. FP8 scales are not keys
    of their own: they come with their weight."""

    def __init__(
        self,
        index: dict[str, StoredTensor],
        block: tuple[int, int] = DEFAULT_BLOCK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._index, self.block, self.dtype = index, block, dtype
        self._samples: dict[str, bytes] = {}  # a hash of the digest's sample of each tensor read whole so far
        # An ordered set: the file order, scales left out.
        self._names = dict.fromkeys(
            k for k in index if not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in index)
        )
        for k in self._names:
            if index[k].dtype in FP8 and k + SCALE_SUFFIX not in index:
                raise ValueError(
                    f"{index[k].file}: FP8 tensor {k} has no {k + SCALE_SUFFIX} (block scales) beside it"
                )

    @classmethod
    def open(cls, path: Path) -> HFWeights:
        """Every *.safetensors file of directory `path`, headers read, no tensor."""
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        cfg_file = path / "config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        index: dict[str, StoredTensor] = {}
        for f in files:
            index.update(read_header(f))
        return cls(index, fp8_block_size(cfg))

    def converted(self, dtype: torch.dtype | None) -> HFWeights:
        """The same tensors, read as `dtype` (see the class docstring)."""
        view = HFWeights.__new__(HFWeights)
        view._index, view._names, view.block, view.dtype = self._index, self._names, self.block, dtype
        view._samples = self._samples
        return view

    def stored(self, name: str) -> StoredTensor:
        return self._index[name]

    @property
    def stored_nbytes(self) -> int:
        """Bytes of tensor data in the files (FP8 scales included)."""
        return sum(t.nbytes for t in self._index.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        t = self._read(name)
        if t.dtype in FP8:
            return dequantize_fp8(t, self._read(name + SCALE_SUFFIX), self.block, self.dtype or torch.float32)
        return self._converted(t)

    def read_index(self, name: str, i: int) -> torch.Tensor:
        """`self[name][i]` with only that slice read: one expert of a stacked [E, N, K] tensor. FP8 scales
        are one per tensor or one grid per expert ([E, N / bn, K / bk])."""
        if name not in self._names:
            raise KeyError(name)
        st = self._index[name]
        if not st.shape or not 0 <= i < st.shape[0]:
            raise IndexError(f"{name}: index {i} outside its shape {list(st.shape)}")
        t = self._read(name, i)
        if t.dtype in FP8:
            s = self._read(name + SCALE_SUFFIX)
            s = s[i] if s.dim() == len(st.shape) else s
            return dequantize_fp8(t, s, self.block, self.dtype or torch.float32)
        return self._converted(t)

    def _converted(self, t: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            return t.to(self.dtype)
        return t

    def _read(self, name: str, index: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The stored tensor; its slice `index` along the first dimension; or with `stop`, the slices
        `index` to `stop` (rows)."""
        st = self._index[name]
        shape, offset, nbytes = st.shape, st.offset, st.nbytes
        if index is not None:
            row = nbytes // st.shape[0]
            count = 1 if stop is None else stop - index
            shape = st.shape[1:] if stop is None else (count, *st.shape[1:])
            offset += index * row
            nbytes = count * row
        trim_heap()
        t = torch.empty(shape, dtype=st.dtype)
        buf = memoryview(t.view(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
        with open(st.file, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < nbytes:  # one read returns at most ~2 GB
                n = f.readinto(buf[done:])
                if not n:
                    raise ValueError(f"{st.file}: ends inside tensor {name}")
                done += n
        if index is None and name not in self._samples:
            flat = t.view(-1)
            self._samples[name] = _sample_hash(
                flat[_sample_index(flat.numel())].view(torch.uint8).numpy().tobytes()
            )
        return t

    def quantized(self, name: str, mode: str) -> Staged | None:
        """`quant.quantize(self[name], mode)`, read a bounded number of rows at a time: a large matrix (an
        output head) is never whole in its stored dtype beside its quantized copy. Both formats quantize
        row by row (int8 a scale a row, int4 groups along a row), so the result is quantize's, bit for
        bit. None where this does not apply (not a float matrix, FP8, a shape `mode` cannot hold)."""
        st = self._index.get(name)
        if (
            name not in self._names
            or st is None
            or st.dtype in FP8
            or not st.dtype.is_floating_point
            or len(st.shape) != 2
            or not can_quantize(torch.empty(st.shape, device="meta"), mode)
        ):
            return None
        n, k = st.shape
        step = max(1, _ROWS_READ // max(1, k * st.dtype.itemsize))
        q = scale = zero = None
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            part = quantize(self._converted(self._read(name, r0, r1)), mode)
            if q is None:
                q = torch.empty((n, *part.q.shape[1:]), dtype=part.q.dtype)
                scale = torch.empty((n, *part.scale.shape[1:]), dtype=part.scale.dtype)
                if part.zero is not None:
                    zero = torch.empty((n, *part.zero.shape[1:]), dtype=part.zero.dtype)
            q[r0:r1] = part.q
            scale[r0:r1] = part.scale  # type: ignore[index]
            if zero is not None:
                zero[r0:r1] = part.zero
        assert q is not None and scale is not None
        return Staged(mode, q, scale, zero)

    def digest(self) -> str:
        """A digest of the checkpoint: every stored tensor's name, dtype, shape and a spread sample of its
        stored values (FP8 scales included), the same whatever the files' names, sharding or order, and
        whatever has been read: a tensor read whole was sampled as it was read, any other is sampled
        from its file now."""
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self._index):
            st = self._index[name]
            h.update(f"{name}|{list(st.shape)}|{st.dtype}|".encode())
            sample = self._samples.get(name)
            h.update(sample if sample is not None else _sample_hash(self._sample_from_file(st)))
        return h.hexdigest()

    @staticmethod
    def _sample_from_file(st: StoredTensor) -> bytes:
        size = st.dtype.itemsize
        fd = os.open(st.file, os.O_RDONLY)
        try:
            return b"".join(
                os.pread(fd, size, st.offset + int(j) * size) for j in _sample_index(st.nbytes // size)
            )
        finally:
            os.close(fd)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def _sample_hash(sample: bytes) -> bytes:
    """What the digest keeps of a tensor's sample (a model may have tens of thousands of tensors)."""
    return hashlib.blake2b(sample, digest_size=16).digest()


def _sample_index(numel: int) -> torch.Tensor:
    """The elements the digest samples: evenly spaced, first and last included (in integers: a float
    linspace rounds past the end)."""
    k = min(numel, DIGEST_SAMPLES)
    return torch.arange(k, dtype=torch.int64) * (numel - 1) // max(k - 1, 1)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files by its HF name, read one at a time, floating
    ones as stored (FP8 dequantized to float32)."""
    return dict(HFWeights.open(path))
