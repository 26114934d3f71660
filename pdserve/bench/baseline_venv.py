"""A baseline installed on demand into its own virtual environment under the benchmarks' cache
(~/.cache/pdserve/<name>, or $PDSERVE_CACHE/<name>), made once and reused: vLLM's CPU build and
lm-evaluation-harness pin packages that must not meet pdserve's. A marker file names the version
whose install finished and imported, so a half-done install is never taken for a whole one."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

from pdserve.common.paths import cache_root


class InstallError(RuntimeError):
    pass


def cache_dir(name: str) -> Path:
    return cache_root() / name


def venv_python(cache: Path) -> Path:
    return cache / "venv" / "bin" / "python"


def marker(cache: Path, version: str) -> Path:
    return cache / "venv" / f"pdserve-installed-{version}"


def installed(cache: Path, version: str) -> Path | None:
    """The venv's interpreter when `version` was installed and imported there, else None."""
    py = venv_python(cache)
    return py if marker(cache, version).exists() and py.exists() else None


def run(
    cmd: list[str], log: Callable[[str], None], logfile: Path, nice: int = 19, env: dict | None = None
) -> None:
    """One install step, niced (unpacking must not starve what else runs), its output in `logfile`."""
    full = (["nice", "-n", str(nice)] if nice else []) + cmd
    log("$ " + " ".join(full))
    with open(logfile, "ab") as out:
        r = subprocess.run(full, stdout=out, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        tail = logfile.read_text(errors="replace")[-2000:]
        raise InstallError(
            f"{Path(cmd[0]).name} {' '.join(cmd[1:4])} failed ({r.returncode}); log {logfile}:\n{tail}"
        )
