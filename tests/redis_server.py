"""A real, throwaway redis-server on a free loopback port, for any test that needs Redis.

Use it as a context manager (`with RedisServer() as srv: srv.url`); tests/cache/conftest.py wraps
it in the `redis_server` fixture. Tests skip when no redis-server binary is installed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from pdserve.bench.procs import free_port


def _ping(port: int, timeout: float) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, start_timeout: float = 10.0) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.start_timeout = start_timeout
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self) -> RedisServer:
        if not Path(self.binary).exists():
            pytest.skip("redis-server is not installed")
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        # No persistence: a test server starts empty and leaves nothing behind.
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.start_timeout
        while not _ping(self.port, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
