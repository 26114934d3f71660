"""The core-sharing directory (utils/core_share.py): what a worker reads of its peers' files, real
processes standing in for the peers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.utils import core_share
from pdserve.utils.core_share import CoreShare


@pytest.fixture
def sleeper():
    procs = []

    def start() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _peer(directory, pid: int, threads: int, busy: bool, borrowing: bool = False) -> None:
    (directory / str(pid)).write_bytes(bytes([busy, borrowing, 0, 0]) + threads.to_bytes(4, "little"))


def test_a_decode_step_takes_the_threads_of_idle_peers_only(tmp_path, sleeper, monkeypatch):
    monkeypatch.setattr(core_share, "RESCAN_S", 0.0)
    share = CoreShare(tmp_path, 1, cores=8)
    share.set_busy(True, borrowing=True)
    assert share.step_threads() == 1  # alone
    a, b = sleeper(), sleeper()
    _peer(tmp_path, a.pid, 2, busy=False)
    _peer(tmp_path, b.pid, 3, busy=True)  # a prefill computing: its threads are its own
    assert share.lent() == 2 and share.step_threads() == 3
    _peer(tmp_path, b.pid, 3, busy=False)  # b's work is done
    assert share.step_threads() == 6
    share.set_busy(True, borrowing=False)  # a prefill step of its own: it takes nothing
    assert share.lent() == 0
    assert share.path.read_bytes()[:2] == bytes([1, 0])  # what peers read of it
    share.set_busy(True, borrowing=True)
    assert share.path.read_bytes()[:2] == bytes([1, 1])
    share.set_busy(False)
    assert share.path.read_bytes()[:2] == bytes([0, 0])
    share.close()
    assert not share.path.exists()


def test_never_more_threads_than_cores_and_never_from_the_dead(tmp_path, sleeper, monkeypatch):
    monkeypatch.setattr(core_share, "RESCAN_S", 0.0)
    share = CoreShare(tmp_path, 1, cores=2)
    share.set_busy(True, borrowing=True)
    live, dead = sleeper(), sleeper()
    _peer(tmp_path, live.pid, 4, busy=False)
    _peer(tmp_path, dead.pid, 4, busy=False)
    assert share.step_threads() == 2  # 1 + 8 idle, within the 2 cores
    live.kill()
    live.wait()
    dead.kill()
    dead.wait()
    assert share.lent() == 0  # killed before they could remove their files
    share.close()


def test_borrowers_divide_the_idle_threads_never_taking_one_twice(tmp_path, sleeper, monkeypatch):
    """1P2D on two cores: with both decode workers stepping, the idle prefill worker's core is not
    free (their own threads fill the cores); with one of them idle, the other takes one thread, not
    two. Spare threads are split, the remainder going to the lowest process id."""
    monkeypatch.setattr(core_share, "RESCAN_S", 0.0)
    share = CoreShare(tmp_path, 1, cores=2)
    share.set_busy(True, borrowing=True)
    prefill, other = sleeper(), sleeper()
    _peer(tmp_path, prefill.pid, 1, busy=False)
    _peer(tmp_path, other.pid, 1, busy=True, borrowing=True)
    assert share.step_threads() == 1
    _peer(tmp_path, other.pid, 1, busy=False)
    assert share.step_threads() == 2  # two idle threads, one core free
    share.close()

    share = CoreShare(tmp_path, 1, cores=5)
    share.set_busy(True, borrowing=True)
    _peer(tmp_path, other.pid, 1, busy=True, borrowing=True)
    _peer(tmp_path, prefill.pid, 3, busy=False)  # 3 spare threads for 2 borrowers
    assert share.lent() == (2 if int(share.path.name) < other.pid else 1)
    share.close()


def test_peers_are_found_and_dropped_between_scans(tmp_path, sleeper, monkeypatch):
    share = CoreShare(tmp_path, 1, cores=4)
    share.set_busy(True, borrowing=True)
    share.lent()  # scanned: no peers
    p = sleeper()
    _peer(tmp_path, p.pid, 1, busy=False)
    assert share.lent() == 0  # not rescanned yet
    monkeypatch.setattr(core_share, "RESCAN_S", 0.0)
    assert share.lent() == 1
    (tmp_path / str(p.pid)).unlink()  # stopped, its file removed
    assert share.lent() == 0
    share.close()
