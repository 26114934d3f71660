"""Kernel paths chosen by timing them on the machine (kernels/tuning.py): the rule that turns the
measured ratios into a row count, and on a CPU with bfloat16 products (AMX's tiles or AVX512-BF16's
pairs) the measurement, its cache and the kernel taking the chosen counts."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pdserve.common.paths import cache_root
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
    # A choice that must win by a margin (AMX's two tiles a block: the same sums either way).
    pairs = {576: 0.98, 1024: 0.9, 1536: 0.93, 2048: 0.85}
    assert tuning.choose(pairs, tuning.NO_TILE_PAIRS, tuning.PAIR_GAIN) == 1024
    assert tuning.choose(pairs, tuning.NO_TILE_PAIRS) == 576
    assert (
        tuning.choose({576: 1.0, 2048: 0.98}, tuning.NO_TILE_PAIRS, tuning.PAIR_GAIN) == tuning.NO_TILE_PAIRS
    )


def test_tuning_is_measured_once_cached_and_applied(tmp_path, monkeypatch):
    """On AMX's tiles where they run (the exact tiles' start, the rounded tile's and int8's, and below
    which rows the vectors copy the tiles where they can), else on the
    AVX512-BF16 pairs (the rounded tile's), and on AVX-512 builds the register rows' lookup: measured,
    cached, read back as cached, and taken by the products."""
    paths = tuning.machine_choices()
    if not paths:
        pytest.skip("no kernel choice here: nothing to choose")
    by_key = {c.key: c for c in paths}
    bf16 = "avx512_bf16" in cpu_flags()
    amx = bf16 and "amx_tile" in cpu_flags() and qgemm.amx()
    assert ("int4_lut_from" in by_key) == qgemm.has_lut()
    vectors = amx and qgemm.amx_vectors_agree()
    assert len(paths) == qgemm.has_lut() + (4 + 2 * vectors if amx else 1 if bf16 else 0)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    tuning.tune.cache_clear()
    try:
        chosen = tuning.tune()
        [path] = (tmp_path / "kernels").glob("tuning-*.json")
        assert json.loads(path.read_text()) == chosen
        for c in paths:
            assert min(c.rows) <= chosen[c.key] <= c.none
            assert set(chosen[c.ratios]) == {str(r) for r in c.rows}
        exact, rounded = by_key.get("int4_exact_from"), by_key.get("int4_tiles_from")
        int8 = by_key.get("int8_tiles_from")
        if amx:
            assert exact is not None and rounded is not None and int8 is not None
            assert (
                qgemm.bf16_rows("int4") == chosen[exact.key] and qgemm.amx_rows("int4") == chosen[rounded.key]
            )
            assert qgemm.bf16_rows("int8") == qgemm.amx_rows("int8") == chosen[int8.key]
        rounded = rounded or by_key.get("int4_rounded_from")
        # Read back, not measured again: the cached choice is applied as it is.
        forced = {c.key: 5 if c is not rounded else 20 for c in paths}
        path.write_text(json.dumps({**chosen, **forced}))
        tuning.tune.cache_clear()
        assert {c.key: tuning.tune()[c.key] for c in paths} == forced
        if amx:
            assert qgemm.bf16_rows("int4") == 5 and qgemm.amx_rows("int4") == 20
            assert qgemm.bf16_rows("int8") == 5
        if vectors:  # the same bits either way: read back from the kernel
            assert qgemm.paths()["amx_vectors4_below"] == qgemm.paths()["amx_vectors8_below"] == 5
        # A product from each chosen count on takes that path (its sums differ from the other's).
        from pdserve.model.linear import linear
        from pdserve.model.quant import QuantizedWeight, quantize

        g = torch.Generator().manual_seed(0)
        qw = QuantizedWeight(quantize(torch.randn(64, 256, generator=g), "int4"), native=True)
        x = torch.randn(20, 256, generator=g)
        q8 = QuantizedWeight(quantize(torch.randn(64, 256, generator=g), "int8"), native=True)
        tile, few, few8 = linear(x, qw), linear(x[:5], qw), linear(x[:5], q8)
        if rounded is not None:
            rounded.set_start(rounded.none)
            assert not torch.equal(tile, linear(x, qw))
        if exact is not None:
            exact.set_start(exact.none)
            assert not torch.equal(few, linear(x[:5], qw))
        if int8 is not None:
            int8.set_start(int8.none)
            assert not torch.equal(few8, linear(x[:5], q8))
    finally:
        tuning.tune.cache_clear()
        for c in paths:
            c.set_start(c.unmeasured)


def test_processes_starting_together_measure_once_and_take_the_same_paths(tmp_path, monkeypatch):
    """Three processes tune at once on a cache without a tuning (a deployment's workers starting on a
    fresh machine): one measures, the others wait for it and read its choices, and all three take the
    cached paths (measured apart, choices near a threshold could differ, and so would a row's bits
    between a prefill worker and a decode worker)."""
    if not tuning.machine_choices():
        pytest.skip("no kernel choice here: nothing to choose")
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    for so in (cache_root() / "kernels").glob("*.so"):  # built already: the processes only load them
        shutil.copy2(so, kernels / so.name)
    code = (
        "import json, logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from pdserve.model.kernels import qgemm, tuning\n"
        "tuning.tune(); print(json.dumps(qgemm.paths()))"
    )
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    assert sum("measured on this machine" in err for _, err in outs) == 1
    [path] = kernels.glob("tuning-*.json")
    cached = json.loads(path.read_text())
    paths = [json.loads(out) for out, _ in outs]
    assert paths[0] == paths[1] == paths[2]
    # The cached choices, applied here, are the paths each process took.
    saved = qgemm.paths()
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    tuning.tune.cache_clear()
    try:
        assert tuning.tune() == cached
        assert qgemm.paths() == paths[0]
    finally:
        tuning.tune.cache_clear()
        qgemm.set_paths(saved)


def test_the_register_rows_lookup_gives_the_converted_floats():
    """int4's register rows with the nibbles looked up compute the bits the converted nibbles do, at
    every row count they cover (1-8) and on a partial last tile chunk, one thread and two."""
    if not qgemm.has_lut():
        pytest.skip("this build converts its nibbles only")
    from pdserve.model.linear import linear
    from pdserve.model.quant import QuantizedWeight, quantize

    g = torch.Generator().manual_seed(1)
    qw = QuantizedWeight(quantize(torch.randn(96, 320, generator=g), "int4"), native=True)
    w = qw.dequantize().double()
    bound, threads = qgemm.invariant_bound(), torch.get_num_threads()
    exact_from = qgemm.bf16_rows("int4") or tuning.NO_EXACT
    qgemm.invariant_rows(0)  # the row-count paths, where the register rows run
    qgemm.amx_exact_from(tuning.NO_EXACT)  # and not AMX's exact tiles (a model load's tuning may start them)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in range(1, 9):
                x = torch.randn(rows, 320, generator=g) * 3
                qgemm.lut_from(tuning.NO_LUT)
                converted = linear(x, qw)
                qgemm.lut_from(1)
                looked_up = linear(x, qw)
                assert torch.equal(converted, looked_up), (n, rows)
                # float32 sums of K terms: each step's rounding bounded by the magnitudes' sum
                tol = (x.abs().double() @ w.abs().T) * 320 * 2.0**-23
                assert ((looked_up.double() - x.double() @ w.T).abs() <= tol).all()
    finally:
        qgemm.amx_exact_from(exact_from)
        qgemm.lut_from(tuning.NO_LUT)
        qgemm.invariant_rows(bound)
        torch.set_num_threads(threads)


def test_the_two_tile_blocks_are_timed_on_the_row_count_paths_and_leave_settings_as_they_were():
    """AMX's two tiles a block are timed at each depth with model.batch_invariant's bound lifted (its
    PAIR_ROWS rows would take the exact tiles, where blocks do not apply) and both settings restored."""
    pairs = [c for c in tuning.machine_choices() if c.by_depth]
    if not pairs:
        pytest.skip("no AMX tiles here: no blocks to time")
    bound, depth = qgemm.invariant_bound(), qgemm.amx_tile_pairs_start()
    seen = []

    def spy(k: int) -> None:  # the bound in force as each setting is timed
        seen.append(qgemm.invariant_bound())
        qgemm.amx_tile_pairs_from(k)

    qgemm.invariant_rows(tuning.PAIR_ROWS)
    try:
        ratios = tuning.measure(dataclasses.replace(pairs[0], set_start=spy))
        assert seen and set(seen[:-1]) == {0}
        assert set(ratios) == set(tuning.DEPTHS) and all(r > 0 for r in ratios.values())
        assert qgemm.invariant_bound() == tuning.PAIR_ROWS
        assert qgemm.amx_tile_pairs_start() == tuning.NO_TILE_PAIRS  # left off, as measured against
    finally:
        qgemm.invariant_rows(bound)
        qgemm.amx_tile_pairs_from(depth)
