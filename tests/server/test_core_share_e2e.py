"""`pdserve serve` on one machine: its prefill and decode workers share one core-sharing directory,
and the decode worker's steps take the idle prefill worker's thread (its /metrics counts them) while
the text stays what the same deployment gives without sharing (utils/core_share.py)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from proc_environ import environ

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-llama"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="borrowing needs two cores"),
]


def _children(pid: int) -> list[int]:
    """The worker processes the launcher started (its children that run `pdserve.cli worker`)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if b"worker" in Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")]


def _serve(tmp_path: Path, name: str, *extra: str) -> tuple[str, dict[str, float], set[str]]:
    """One deployment's greedy text, its decode worker's step counters, the workers' sharing dirs."""
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--model", MODEL, "--prefill", "1", "--decode", "1", "--port", str(port)]
    with ServerProcess(cmd + list(extra), port, tmp_path / f"{name}.log") as srv:
        srv.wait_ready(timeout=300)
        body = {
            "model": MODEL,
            "prompt": "one two three",
            "max_tokens": 96,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        workers = httpx.get(srv.url + "/admin/workers", timeout=10).json()["workers"]
        decode = next(w["url"] for w in workers if w["role"] == "decode")
        metrics = httpx.get(decode + "/metrics", timeout=10).text
        dirs = {environ(pid).get("PDSERVE_CORE_SHARE", "") for pid in _children(srv.proc.pid)}
        assert len(workers) == 2
    counts = {
        name: float(line.split()[-1])
        for line in metrics.splitlines()
        for name in ("pdserve_decode_steps_total", "pdserve_decode_steps_borrowing_total")
        if line.startswith(name + " ") or line.startswith(name + "{")
    }
    return r.json()["choices"][0]["text"], counts, dirs


def test_decode_steps_borrow_the_idle_prefill_workers_thread(tmp_path):
    text, counts, dirs = _serve(tmp_path, "shared")
    assert len(dirs) == 1 and "" not in dirs  # one directory, given to both workers
    assert counts["pdserve_decode_steps_borrowing_total"] > 0
    assert counts["pdserve_decode_steps_borrowing_total"] <= counts["pdserve_decode_steps_total"]
    own_text, own_counts, own_dirs = _serve(tmp_path, "own", "--no-share-idle-cores")
    assert own_dirs == {""} and own_counts["pdserve_decode_steps_borrowing_total"] == 0
    assert text == own_text
