"""The router gives back every connection it opens to a worker: a stream read to its last token
returns its connection to the pool (reused by the next request) instead of leaving it half-read,
neither pooled nor closed, to sit in CLOSE-WAIT once the worker hangs up (one socket a request)."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

pytestmark = pytest.mark.slow
# uvicorn closes an idle keep-alive connection after 5 s: past that, a leaked one is in CLOSE-WAIT.
WORKER_KEEPALIVE_S = 5.0


def test_streams_return_their_connections(tmp_path):
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--model", "tiny-qwen2", "--prefill", "1", "--decode", "1"]
    with ServerProcess(cmd + ["--port", str(port)], port, tmp_path / "serve.log") as srv:
        srv.wait_ready(timeout=300)
        for i in range(20):
            body = {"model": "tiny-qwen2", "prompt": f"hello {i}", "max_tokens": 4, "stream": bool(i % 2)}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        time.sleep(WORKER_KEEPALIVE_S + 2)
        router = psutil.Process(srv.proc.pid)
        # The router is the process listening on the served port (`serve` may start it as a child).
        for p in [router, *router.children(recursive=True)]:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp")):
                router = p
                break
        waiting = [c for c in router.net_connections("tcp") if c.status == psutil.CONN_CLOSE_WAIT]
        assert not waiting, waiting
