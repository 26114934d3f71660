"""Expert-parallel ranks talk over loopback only: while an EP=2 model runs, neither rank 0 (this
process) nor the spawned rank listens on an address another host could reach, and the ranks'
meeting place is gone once the model is closed."""

from __future__ import annotations

import ipaddress
import os

import pytest

from pdserve import LLM, SamplingParams
from pdserve.model.loader import load_model_files

pytestmark = pytest.mark.slow  # spawns a rank process


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _listening(pids: list[int]) -> list[str]:
    """The local addresses of the TCP sockets these processes listen on (from /proc/net/tcp{,6})."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr = cols[1].split(":")[0]
                raw = bytes.fromhex(hexaddr)
                # /proc prints each 32-bit word in host (little-endian) order.
                addr = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                found.append(str(ipaddress.ip_address(addr)))
    return found


def test_ep_ranks_listen_on_loopback_only():
    llm = LLM(
        model="tiny-qwen2-moe",
        loaded=load_model_files("tiny-qwen2-moe"),
        threads=1,
        device_blocks=32,
        model__expert_parallel=2,
    )
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].token_ids) == 2
        ranks = llm.engine.model._ranks
        pids = [os.getpid(), *(p.pid for p in ranks.procs)]
        addrs = _listening(pids)
        exposed = [a for a in addrs if not ipaddress.ip_address(a).is_loopback]
        assert addrs and not exposed, addrs
        store_dir = ranks._store_dir
        assert store_dir and os.stat(store_dir).st_mode & 0o077 == 0  # private to this user
    finally:
        llm.engine.close()
    assert not os.path.exists(store_dir)
