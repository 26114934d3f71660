"""EleutherAI's lm-evaluation-harness as an outside client: install it on demand, run it.

It lands in a cache outside the repository (~/.cache/pdserve/lm-eval, or $PDSERVE_CACHE/lm-eval),
made once and reused, as vLLM's CPU build is (bench/vllm_cpu.py):

- venv/: its own virtual environment with torch (the CPU wheel), `lm-eval` with its `api` and `hf`
  extras, pinned; its transformers and datasets must not meet pdserve's.
- home/: HF_HOME and HF_DATASETS_CACHE for the runs (the local tasks' json files are cached there).

Its `--model hf` reads the same float32 HF directory that vLLM serves (vllm_cpu.convert: the
default GGUF dequantized by transformers), so the harness's in-process scores and pdserve's served
scores come from the same weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from pdserve.bench import baseline_venv
from pdserve.bench.baseline_venv import marker, run, venv_python

VERSION = "0.4.13"
TORCH = "torch==2.13.0"


def cache_dir() -> Path:
    return baseline_venv.cache_dir("lm-eval")


def installed(cache: Path | None = None) -> Path | None:
    """The venv's interpreter when lm-eval VERSION was installed and imported there, else None."""
    return baseline_venv.installed(cache or cache_dir(), VERSION)


def install(cache: Path | None = None, log: Callable[[str], None] = print, nice: int = 19) -> Path:
    """Install lm-eval into cache/venv once; return the venv's interpreter.

    torch goes in first and alone, so that lm-eval's `hf` extra finds it satisfied and pulls no
    other build of it."""
    cache = cache or cache_dir()
    found = installed(cache)
    if found:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    logfile = cache / "install.log"
    py = venv_python(cache)
    if not py.exists():
        run([sys.executable, "-m", "venv", str(cache / "venv")], log, logfile, nice)
    pip = [str(py), "-m", "pip", "install", "--progress-bar", "off"]
    run([*pip, TORCH], log, logfile, nice)
    run([*pip, f"lm-eval[api,hf]=={VERSION}"], log, logfile, nice)
    run([str(py), "-c", "import lm_eval, torch, transformers; print('lm_eval ok')"], log, logfile, nice)
    marker(cache, VERSION).write_text(VERSION + "\n")
    return py


def env(base: dict, cache: Path | None = None, threads: int = 2) -> dict:
    """The harness's environment: local files only, its caches inside the cache directory."""
    cache = cache or cache_dir()
    home = cache / "home"
    e = dict(base)
    e.update(
        {
            "HF_HOME": str(home),
            "HF_DATASETS_CACHE": str(home / "datasets"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
        }
    )
    return e


if __name__ == "__main__":
    print(install())
