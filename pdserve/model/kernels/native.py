"""Builds the C kernels beside this file once per CPU feature set and loads them with ctypes.

Plain C with no torch headers: a build takes about a second, so it happens on first use instead of
at install. The vector flags come from the detected features (utils.cpu), never -march=native, so a
cache shared by different CPUs holds one build per feature set. OpenMP resolves to the runtime torch
has already loaded (same soname), so the kernels and torch share one thread pool. Without a working
C compiler the callers keep their torch path (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from pdserve.common.paths import cache_root
from pdserve.utils.cpu import cpu_flags, feature_key

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
# Detected feature -> compiler flag (only features that change code generation).
_MFLAGS = {
    "avx2": "-mavx2",
    "fma": "-mfma",
    "f16c": "-mf16c",
    "avx512f": "-mavx512f",
    "avx512bw": "-mavx512bw",
    "avx512vl": "-mavx512vl",
    "avx512_bf16": "-mavx512bf16",
    "avx512_vnni": "-mavx512vnni",  # qgemm_q8.c's vpdpbusd (with avx512vl)
    "avx_vnni": "-mavxvnni",
    "amx_tile": "-mamx-tile",  # qgemm_bf16.c's tile products (with amx_bf16)
    "amx_bf16": "-mamx-bf16",
}
# Never -ffast-math: linking a shared library with it pulls in crtfastmath, which sets flush-to-zero
# for the whole process as the library loads (caught by a test: subnormal floats vanished elsewhere).
# The reductions vectorize through `omp simd` instead.
CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-mtune=generic"]


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# Libraries that link other kernels' sources in beside their own (the fused decode layer calls them).
LINKED = {
    "qgemm": ["qgemm_bf16", "qgemm_q8"],
    "layer": ["qgemm", "qgemm_bf16", "qgemm_q8", "norm", "decode_attention", "prefill_attention"],
    "moe": ["layer", "qgemm", "qgemm_bf16", "qgemm_q8", "norm", "decode_attention", "prefill_attention"],
}


def build(name: str) -> Path:
    """The shared library for `name`.c (and what LINKED adds), built for this CPU's features unless
    already cached."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    srcs = [HERE / f"{n}.c" for n in [name, *LINKED.get(name, [])]]
    texts = [p.read_text() for p in [*srcs, *sorted(HERE.glob("*.h"))]]
    mflags = [_MFLAGS[f] for f in _MFLAGS if f in cpu_flags()]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout.split(
        "\n"
    )[0]
    digest = hashlib.sha256("\0".join([*texts, version, *CFLAGS, *mflags]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{feature_key()}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together may build the same kernel.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *CFLAGS, *mflags, *map(str, srcs), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {name}.c: {proc.stderr.strip()[-800:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) where it cannot be built here."""
    try:
        return ctypes.CDLL(str(build(name)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native kernel %s unavailable, using the torch path: %s", name, e)
        return None


def function(name: str, symbol: str, argtypes: list) -> Callable[..., None] | None:
    """`symbol` of `name`.c, typed (it returns nothing), or None where the library cannot load here."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = None
    fn.argtypes = argtypes
    return fn


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
