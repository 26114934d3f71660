import logging
import threading
from pathlib import Path

from pdserve.bench.baseline_venv import cache_dir as baseline_dir
from pdserve.common.paths import cache_root, measuring_alone
from pdserve.engine.row_costs import cache_path
from pdserve.model.kernels.native import cache_dir as kernels_dir


def test_every_cache_lives_under_the_one_root(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert kernels_dir() == tmp_path / "kernels"
    assert cache_path("k") == tmp_path / "row-costs" / "k.json"
    assert baseline_dir("vllm-cpu") == tmp_path / "vllm-cpu"


def test_the_root_defaults_to_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "pdserve"
    monkeypatch.setenv("PDSERVE_CACHE", "")  # an empty value means unset, as before
    assert cache_root() == Path(tmp_path) / ".cache" / "pdserve"


def test_measuring_alone_takes_turns_and_runs_unlocked_past_its_deadline(tmp_path, caplog):
    """A second process (here a second open of the lock, as flock counts them) waits for the first;
    past its deadline it runs unlocked and says so; the lock is free again once the holder leaves."""
    path = tmp_path / "m.json"
    order: list[str] = []
    with measuring_alone(path, "m", 5.0):
        waiter = threading.Thread(target=lambda: _take(path, order, 30.0))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and order == []  # waiting for the holder
        order.append("first")
        with caplog.at_level(logging.WARNING, logger="pdserve.common.paths"):
            _take(path, order, 0.1)  # a deadline shorter than the hold: runs unlocked
        assert "without its lock" in caplog.text
    waiter.join(60)  # its own deadline (30 s) would end the wait first
    assert order == ["first", "unlocked", "second"]


def _take(path: Path, order: list[str], timeout_s: float) -> None:
    with measuring_alone(path, "m", timeout_s):
        order.append("unlocked" if timeout_s < 1 else "second")
