"""Server processes for benchmarks and end-to-end tests: start, wait until healthy, stop, kill.

Each server runs in its own process group so that stopping it also stops any workers it forked
(`pdserve serve --mode pd` starts several processes).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log's tail."""


_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port that is free now and stays free until its server binds it.

    A port the kernel picks with bind(0) lies in the ephemeral range, where any outgoing
    connection (the router's to its workers, say) may take it before the server binds it. So the
    port is drawn from below that range, and never twice from one process.
    """
    low = max(_ephemeral_low(), 12000)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, low)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port below the ephemeral range ({low})")


def pdserve_cmd() -> list[str]:
    """How to run the `pdserve` CLI from this interpreter's environment."""
    exe = Path(sys.executable).with_name("pdserve")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from pdserve.cli import main; sys.exit(main())"]


def thread_env(threads: int, base: dict | None = None) -> dict:
    """Environment capping every common thread pool at `threads`, so a server cannot take more
    cores than the comparison gives it (torch reads OMP_NUM_THREADS at start-up)."""
    env = dict(os.environ if base is None else base)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(threads)
    return env


class ServerProcess:
    def __init__(
        self,
        cmd: list[str],
        port: int,
        log_path: str | Path,
        env: dict | None = None,
        health_path: str = "/health",
        nice: int = 0,
    ):
        self.cmd = cmd
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.health_path = health_path
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.cpu_s = 0.0  # the group's CPU seconds, taken as stop() begins (group_cpu_s)
        self._log = open(self.log_path, "wb")
        full = (["nice", "-n", str(nice)] if nice else []) + cmd
        from pdserve.utils.process import die_with_parent

        # Its own group (stop() signals the whole deployment), and gone if this process dies.
        self.proc = subprocess.Popen(
            full,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll the health path until it answers 200; raise ServerStartError otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.cmd[0]} exited with {self.proc.returncode}:\n" + self.log_tail()
                )
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet, or still loading
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"not healthy after {timeout:.0f}s:\n" + self.log_tail())

    def kill(self) -> None:
        """SIGKILL the whole group at once: to clients this looks like a crash, not a drain."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def group_cpu_s(self) -> float:
        """CPU seconds used so far by the server's process group: every live member's own time and that
        of the children it reaped. Taken before stop(), it also covers processes the leader never waits
        for (a vLLM engine core), which this process's getrusage(RUSAGE_CHILDREN) would miss."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            f = stat[stat.rindex(")") + 2 :].split()
            # After the command: state, ppid, pgrp, ..., utime (12th), stime, cutime, cstime.
            if int(f[2]) == self.proc.pid:
                total += sum(int(x) for x in f[11:15])
        return total / tick

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                self.cpu_s = self.group_cpu_s()
            except OSError:  # no /proc
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                self.kill()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        # Children that outlived the leader (forked workers) go with the group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
