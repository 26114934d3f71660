"""Kernel paths chosen by timing them on this machine, once, and cached per CPU model, flags and
kernel build (never assumed per CPU family).

Two choices so far, both for int4 products on Intel AMX's tiles (qgemm_bf16.c), each measured on one
int4 product at a few row counts, one thread, the tiles starting at the first count from which they
are faster at every count measured:

- from how many rows the rounded tile (the weight dequantized and rounded to bfloat16, summed over
  all of K in the tile) replaces the exact tiles or pairs (the nibbles exact, each group's scale and
  offset in float32 after its sums). The rounded tile does more work per weight and none per group
  and row, so it wins from some row count; where depends on the core.
- from how many rows the exact tiles replace the float32 kernel (qgemm.c) below that. A tile's
  latency is the same for 1 row as for 16 and the float32 kernel's FMAs grow with the rows, so this
  too lies where the core's tile latency and FMA rate put it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import lru_cache
from pathlib import Path

import torch

from pdserve.common.paths import cache_root
from pdserve.model.kernels import qgemm
from pdserve.model.kernels.native import build
from pdserve.utils.cpu import cpu_flags, cpu_name, feature_key

log = logging.getLogger(__name__)
ROWS = (9, 12, 16, 17, 20, 24, 28)  # the counts between the bfloat16 rows and the rounded tile's 32
EXACT_ROWS = (1, 2, 3, 4, 6, 8)  # the float32 kernel's counts (qgemm.c's register rows)
NO_EXACT = 9  # qgemm_bf16.c's BF16_ROWS4: where the exact tiles start without a measurement
SHAPE = (1024, 1024)  # a product small enough to stay in cache: the kernels' arithmetic, not memory
NO_TILES = 32  # qgemm_bf16.c's BF16_ROWS: where int4 takes the tiles without a measurement


def best_time(fn, repeats: int = 5, inner: int = 4) -> float:
    """The fastest of `repeats` timings of `inner` calls of fn, per call (after one call to warm up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def _int4_ratios(rows_list: tuple[int, ...], set_start, off: int) -> dict[int, float]:
    """Per row count: the product's time with the path starting there (set_start(rows)) over its time
    with the path off (set_start(off)); below 1 the path is faster."""
    from pdserve.model.linear import linear
    from pdserve.model.quant import QuantizedWeight, quantize

    g = torch.Generator().manual_seed(0)
    qw = QuantizedWeight(quantize(torch.randn(*SHAPE, generator=g) * 0.05, "int4"), native=True)
    threads, invariant = torch.get_num_threads(), qgemm.invariant_bound()
    torch.set_num_threads(1)
    qgemm.invariant_rows(0)  # the row-count paths are what is measured
    ratios = {}
    try:
        for rows in rows_list:
            x = torch.randn(rows, SHAPE[1], generator=g)
            times = []
            for start in (rows, off):
                set_start(start)
                times.append(best_time(lambda: linear(x, qw)))
            ratios[rows] = times[0] / times[1]
    finally:
        torch.set_num_threads(threads)
        qgemm.invariant_rows(invariant)
        set_start(off)
    return ratios


def measure_int4_tiles() -> dict[int, float]:
    """Per row count: the rounded tile's time over the exact tiles' or pairs' (below 1: faster)."""
    return _int4_ratios(ROWS, qgemm.amx_from, NO_TILES)


def measure_int4_exact() -> dict[int, float]:
    """Per row count: the exact tiles' time over the float32 kernel's (below 1: faster)."""
    return _int4_ratios(EXACT_ROWS, qgemm.amx_exact_from, NO_EXACT)


def choose(ratios: dict[int, float], none: int = NO_TILES) -> int:
    """The first row count from which the path is faster at every count measured (`none`: nowhere)."""
    start = none
    for rows in sorted(ratios, reverse=True):
        if ratios[rows] >= 1.0:
            break
        start = rows
    return start


def _cache_path() -> Path:
    build_id = build("qgemm").stem  # its name holds the feature set and the sources' digest
    model = "".join(c if c.isalnum() else "-" for c in cpu_name())[:60]
    return cache_root() / "kernels" / f"tuning-{model}-{feature_key()}-{build_id[-16:]}.json"


@lru_cache(maxsize=1)
def tune() -> dict:
    """Apply this machine's measured choices (measured now and cached where none are cached yet);
    returns them ({} where there is nothing to choose: no AMX tiles here)."""
    if "amx_tile" not in cpu_flags() or not qgemm.available() or not qgemm.amx():
        return {}
    path = _cache_path()
    try:
        chosen = json.loads(path.read_text())
        start, exact = int(chosen["int4_tiles_from"]), int(chosen["int4_exact_from"])
    except FileNotFoundError:
        chosen = None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable kernel tuning %s: %s", path, e)
        chosen = None
    if chosen is None:
        # The exact tiles first: the rounded tile's measurement compares against them from 9 rows.
        exact_ratios = measure_int4_exact()
        exact = choose(exact_ratios, NO_EXACT)
        qgemm.amx_exact_from(exact)
        ratios = measure_int4_tiles()
        start = choose(ratios)
        chosen = {
            "int4_tiles_from": start,
            "tiles_vs_pairs": {str(r): round(v, 3) for r, v in ratios.items()},
            "int4_exact_from": exact,
            "exact_vs_float32": {str(r): round(v, 3) for r, v in exact_ratios.items()},
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(chosen))
            tmp.replace(path)  # atomic: workers starting together never read half a file
        except OSError as e:
            log.warning("could not cache kernel tuning in %s: %s", path, e)
        log.info(
            "int4 products take AMX's exact tiles from %d rows and the rounded tile from %d "
            "(exact / float32: %s; rounded / exact: %s)",
            exact,
            start,
            exact_ratios,
            ratios,
        )
    qgemm.amx_exact_from(exact)
    qgemm.amx_from(start)
    return chosen
