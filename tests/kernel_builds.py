"""Kernels (qgemm with the bfloat16 and int8-activation products it links, prefill attention) built by
explicit vector flags into a test's directory: the builds other CPUs run, checked on this one where it
can run them."""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from pdserve.model.kernels import native, qgemm, tuning

AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX2_NEEDS = ["avx2", "fma", "f16c"]


@contextmanager
def unmeasured_paths() -> Iterator[None]:
    """The kernel's own row-count starts (a fresh process's, before any tuning) inside the block, this
    machine's after: for checks whose row counts must fall on both sides of a path's start, wherever
    this machine's tuning put it (an int8 start of 1 row leaves nothing below it)."""
    saved = qgemm.paths()
    try:
        for c in tuning.machine_choices():
            c.set_start(c.unmeasured)
        yield
    finally:
        qgemm.set_paths(saved)


def build_library(tmp_path, name: str, sources: list[str], flags: list[str]) -> ctypes.CDLL | None:
    """The kernels' `sources` (names of .c files) built with `flags`, or None where this compiler or
    architecture does not take them."""
    srcs = [str(native.HERE / f"{n}.c") for n in sources]
    out = tmp_path / f"{name}.so"
    proc = subprocess.run(
        [native._compiler(), *native.CFLAGS, *flags, *srcs, "-o", str(out), "-lm"],
        capture_output=True,
        text=True,
        check=False,
    )
    return ctypes.CDLL(str(out)) if proc.returncode == 0 else None


def build_qgemm(tmp_path, name: str, flags: list[str]) -> ctypes.CDLL | None:
    return build_library(tmp_path, name, ["qgemm", "qgemm_bf16", "qgemm_q8"], flags)


def runnable_qgemm(tmp_path, name: str, flags: list[str], needs: list[str]) -> tuple[ctypes.CDLL, Callable]:
    """The build and its pd_qgemm, typed; skips the test where the build fails (the portable one must
    not) or this CPU lacks a feature it needs."""
    from pdserve.utils.cpu import cpu_flags

    lib = build_qgemm(tmp_path, name, flags)
    if lib is None:
        if not flags:
            pytest.fail("the portable build failed")
        pytest.skip(f"{name}: this compiler or architecture does not take {flags}")
    if not set(needs) <= cpu_flags():
        pytest.skip(f"{name} built; this CPU cannot run it")
    fn = lib.pd_qgemm
    fn.restype = None
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [i, p, p, p, p, i64, p, i64, i, i, i, i]
    return lib, fn
