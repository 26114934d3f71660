from __future__ import annotations

import pytest

from pdserve.config import load_config


def test_defaults_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  name: tiny-llama\ncache:\n  block_size: 32\nscheduler:\n  max_num_seqs: 4\n")
    cfg = load_config(f, {"cache.block_size": 8, "server.port": None})
    assert cfg.model.name == "tiny-llama" and cfg.cache.block_size == 8
    assert cfg.scheduler.max_num_seqs == 4 and cfg.server.port == 8000


def test_unknown_keys_are_rejected(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  blok_size: 32\n")
    with pytest.raises(ValueError, match="blok_size"):
        load_config(f)
    with pytest.raises(ValueError):
        load_config(None, {"nope.x": 1})


def test_example_config_loads():
    cfg = load_config("examples/mixed.yaml")
    assert cfg.model.name == "smollm2-135m"
