"""Kernel paths chosen by timing them on the machine (kernels/tuning.py): the rule that turns the
measured ratios into a row count, and on a CPU with AMX tiles the measurement, its cache and the
kernel taking the chosen count."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.model.kernels import qgemm, tuning
from pdserve.utils.cpu import cpu_flags


def test_the_tiles_start_where_they_are_faster_at_every_count_above():
    assert tuning.choose({9: 0.8, 12: 0.7, 16: 0.5, 24: 0.4}) == 9
    assert tuning.choose({9: 1.3, 12: 0.9, 16: 0.5, 24: 0.4}) == 12
    # One slower count above a faster one: the tiles start past it.
    assert tuning.choose({9: 0.9, 12: 1.1, 16: 0.8, 24: 0.6}) == 16
    assert tuning.choose({9: 1.5, 12: 1.2, 16: 1.1, 24: 1.01}) == tuning.NO_TILES
    assert tuning.choose({}) == tuning.NO_TILES
    # The exact tiles against the float32 kernel: below 9 rows, or nowhere (9: as unmeasured).
    assert tuning.choose({1: 1.3, 2: 1.02, 3: 0.8, 4: 0.7, 6: 0.55, 8: 0.5}, tuning.NO_EXACT) == 3
    assert tuning.choose({1: 1.3, 2: 1.2, 4: 1.1, 8: 1.05}, tuning.NO_EXACT) == tuning.NO_EXACT


def test_tuning_on_a_cpu_with_amx_is_measured_once_cached_and_applied(tmp_path, monkeypatch):
    if "amx_tile" not in cpu_flags() or not qgemm.available() or not qgemm.amx():
        pytest.skip("no AMX tiles here: nothing to choose")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    tuning.tune.cache_clear()
    try:
        chosen = tuning.tune()
        [path] = (tmp_path / "kernels").glob("tuning-*.json")
        assert json.loads(path.read_text()) == chosen
        start = chosen["int4_tiles_from"]
        assert qgemm.bf16_rows("int4") <= start <= tuning.NO_TILES
        assert set(chosen["tiles_vs_pairs"]) == {str(r) for r in tuning.ROWS}
        assert qgemm.amx_rows("int4") == start
        exact = chosen["int4_exact_from"]
        assert 1 <= exact <= tuning.NO_EXACT and qgemm.bf16_rows("int4") == exact
        assert set(chosen["exact_vs_float32"]) == {str(r) for r in tuning.EXACT_ROWS}
        # Read back, not measured again: the cached choice is applied as it is.
        path.write_text(json.dumps({**chosen, "int4_tiles_from": 20, "int4_exact_from": 5}))
        tuning.tune.cache_clear()
        assert tuning.tune()["int4_tiles_from"] == 20 and qgemm.amx_rows("int4") == 20
        assert qgemm.bf16_rows("int4") == 5
        # A product from the chosen count on takes the tiles (its sums differ from the pairs').
        from pdserve.model.linear import linear
        from pdserve.model.quant import QuantizedWeight, quantize

        g = torch.Generator().manual_seed(0)
        qw = QuantizedWeight(quantize(torch.randn(64, 256, generator=g), "int4"), native=True)
        x = torch.randn(20, 256, generator=g)
        tiles = linear(x, qw)
        qgemm.amx_from(tuning.NO_TILES)
        assert not torch.equal(tiles, linear(x, qw))
    finally:
        tuning.tune.cache_clear()
        qgemm.amx_from(tuning.NO_TILES)
        qgemm.amx_exact_from(tuning.NO_EXACT)
