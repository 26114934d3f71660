from pathlib import Path

from pdserve.bench.baseline_venv import cache_dir as baseline_dir
from pdserve.common.paths import cache_root
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
