"""Kernel paths chosen by timing them on the machine (kernels/tuning.py): the rule that turns the
measured ratios into a row count, and on a CPU with bfloat16 products (AMX's tiles or AVX512-BF16's
pairs) the measurement, its cache and the kernel taking the chosen counts."""

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


def test_tuning_is_measured_once_cached_and_applied(tmp_path, monkeypatch):
    """On AMX's tiles where they run (the exact tiles' start and the rounded tile's), else on the
    AVX512-BF16 pairs (the rounded tile's): measured, cached, read back as cached, and taken by the
    products."""
    if "avx512_bf16" not in cpu_flags() or not qgemm.available():
        pytest.skip("no bfloat16 products here: nothing to choose")
    amx = "amx_tile" in cpu_flags() and qgemm.amx()
    paths = tuning.choices(amx)
    assert len(paths) == (2 if amx else 1)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    tuning.tune.cache_clear()
    try:
        chosen = tuning.tune()
        [path] = (tmp_path / "kernels").glob("tuning-*.json")
        assert json.loads(path.read_text()) == chosen
        for c in paths:
            assert min(c.rows) <= chosen[c.key] <= c.none
            assert set(chosen[c.ratios]) == {str(r) for r in c.rows}
        rounded = paths[-1]
        if amx:
            exact = paths[0]
            assert (
                qgemm.bf16_rows("int4") == chosen[exact.key] and qgemm.amx_rows("int4") == chosen[rounded.key]
            )
        # Read back, not measured again: the cached choice is applied as it is.
        forced = {c.key: 5 if c is not rounded else 20 for c in paths}
        path.write_text(json.dumps({**chosen, **forced}))
        tuning.tune.cache_clear()
        assert {c.key: tuning.tune()[c.key] for c in paths} == forced
        if amx:
            assert qgemm.bf16_rows("int4") == 5 and qgemm.amx_rows("int4") == 20
        # A product from each chosen count on takes that path (its sums differ from the other's).
        from pdserve.model.linear import linear
        from pdserve.model.quant import QuantizedWeight, quantize

        g = torch.Generator().manual_seed(0)
        qw = QuantizedWeight(quantize(torch.randn(64, 256, generator=g), "int4"), native=True)
        x = torch.randn(20, 256, generator=g)
        tile, few = linear(x, qw), linear(x[:5], qw)
        rounded.set_start(rounded.none)
        assert not torch.equal(tile, linear(x, qw))
        if amx:
            paths[0].set_start(paths[0].none)
            assert not torch.equal(few, linear(x[:5], qw))
    finally:
        tuning.tune.cache_clear()
        for c in paths:
            c.set_start(c.unmeasured)
