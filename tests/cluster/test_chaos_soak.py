"""The chaos soak (benchmarks/chaos_soak.py), short: a whole PD deployment on namespace hosts under
twice its measured capacity while a seeded schedule of overlapping faults runs (every fault kind
this machine can make at least once). It must end with no violation: every request answered with
its fault-free text or a clear refusal within its deadline, no KV block held after the drain, file
descriptors, threads and resident memory of every process back within bounds of their post-warm-up
values. Nothing here is timed: the load is derived from the capacity measured in the same run and
bounded by the client's in-flight cap; goodput ratios are printed, not asserted. The loopback
variant is what a machine without root runs: the same deployment on loopback addresses, with the
faults that need no link of a host's own."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from cluster.cluster_hosts import unavailable
from cluster.figures import timed

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("chaos_soak", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["chaos_soak"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_chaos_soak_short(tmp_path, capsys):
    reason = unavailable() or (None if shutil.which("redis-server") else "redis-server is not installed")
    if reason:
        pytest.skip(reason)
    soak = _soak_module()
    with timed("chaos soak (test_chaos_soak.py)"):
        rc = soak.main(
            ["--duration", "60", "--seed", "7", "--capacity-s", "9", "--baseline-s", "20"]
            + ["--workdir", str(tmp_path / "w"), "--out", str(tmp_path)]
        )
    out = capsys.readouterr().out
    print(out)
    assert "fault schedule (seed 7)" in out, out
    violations = [x.split("VIOLATION ", 1)[1] for x in out.splitlines() if "  VIOLATION " in x]
    assert not violations, "\n".join(violations)
    assert rc == 0, out
    assert (tmp_path / "chaos_soak_memory.csv").exists()


def test_chaos_soak_on_loopback_hosts(tmp_path, capsys):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    soak = _soak_module()
    kinds = "kill9,sigstop,role_switch,redis_restart,hostile_clients,hostile_peer,rollback,link_down"
    with timed("chaos soak on loopback hosts (test_chaos_soak.py)"):
        rc = soak.main(
            ["--hosts", "loopback", "--kinds", kinds, "--duration", "36", "--seed", "5"]
            + ["--capacity-s", "6", "--baseline-s", "12"]
            + ["--workdir", str(tmp_path / "w"), "--out", str(tmp_path)]
        )
    out = capsys.readouterr().out
    print(out)
    assert "loopback hosts: router, prefill-a" in out, out
    assert "fault kind left out: link_down: loopback hosts share one interface" in out, out
    violations = [x.split("VIOLATION ", 1)[1] for x in out.splitlines() if "  VIOLATION " in x]
    assert not violations, "\n".join(violations)
    assert rc == 0, out
    assert "rollout to " in out, out  # the rollback ran through the host agents
