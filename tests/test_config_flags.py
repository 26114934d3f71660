"""The one table of short config names (config_flags.FLAGS) drives the command line and the LLM
keywords; a loaded Config is frozen and copies derive from it."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cli import _overrides, build_parser
from pdserve.config import Config, derive, for_role, load_config
from pdserve.config_flags import FLAGS, keyword_key


def test_every_flag_names_a_config_key_and_reaches_the_config():
    for name, f in FLAGS.items():
        section, leaf = f.key.split(".")
        assert hasattr(getattr(Config(), section), leaf), name
    args = build_parser().parse_args(
        ["serve", "--block-size", "32", "--no-prefix-cache", "--max-num-seqs", "3"]
    )
    cfg = load_config(None, _overrides(args))
    assert (cfg.cache.block_size, cfg.cache.prefix_cache, cfg.scheduler.max_num_seqs) == (32, False, 3)
    assert (
        keyword_key("max_num_seqs") == "scheduler.max_num_seqs" and keyword_key("kv_remote") == "cache.remote"
    )
    assert keyword_key("cache__block_size") == "cache.block_size"


def test_a_loaded_config_is_frozen_and_copies_derive_from_it():
    cfg = load_config(None, {"deployment.decode.max_num_seqs": 7})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # type: ignore[misc]
    d = derive(cfg, {"server.port": 1234, "deployment.prefill.instances": 3})
    assert (d.server.port, d.deployment.prefill.instances) == (1234, 3)
    assert cfg.server.port != 1234 and cfg.deployment.prefill.instances != 3 and d.model is cfg.model
    dec = for_role(cfg, "decode")
    assert dec.scheduler.max_num_seqs == 7 and cfg.scheduler.max_num_seqs != 7
