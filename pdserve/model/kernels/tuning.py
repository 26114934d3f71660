"""Kernel paths chosen by timing them on this machine, once, and cached per CPU model, flags and
kernel build (never assumed per CPU family).

One choice so far: from how many rows an int4 product takes Intel AMX's tiles (the rounded tile,
qgemm_bf16.c) instead of the exact bfloat16 pairs with float32 group scales. The tiles multiply
16 rows at a time, so below some row count the pairs' work per row is less than a tile's; where
that lies depends on the core (the tiles' throughput, the pairs' vdpbf16ps rate). Measured on one
int4 product at a few row counts between the bfloat16 rows and 32, one thread: the tiles start at
the first count from which they are faster at every count measured.
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
ROWS = (9, 12, 16, 20, 24, 28)  # the counts between the bfloat16 rows and the rounded tile's 32
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


def measure_int4_tiles() -> dict[int, float]:
    """Per row count: the tiles' time over the exact pairs' (below 1: the tiles are faster)."""
    from pdserve.model.linear import linear
    from pdserve.model.quant import QuantizedWeight, quantize

    g = torch.Generator().manual_seed(0)
    qw = QuantizedWeight(quantize(torch.randn(*SHAPE, generator=g) * 0.05, "int4"), native=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = {}
    try:
        for rows in ROWS:
            x = torch.randn(rows, SHAPE[1], generator=g)
            times = []
            for start in (rows, NO_TILES):
                qgemm.amx_from(start)
                times.append(best_time(lambda: linear(x, qw)))
            ratios[rows] = times[0] / times[1]
    finally:
        torch.set_num_threads(threads)
    return ratios


def choose(ratios: dict[int, float]) -> int:
    """The first row count from which the tiles are faster at every count measured (NO_TILES: none)."""
    start = NO_TILES
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
        start = int(chosen["int4_tiles_from"])
    except FileNotFoundError:
        chosen = None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable kernel tuning %s: %s", path, e)
        chosen = None
    if chosen is None:
        ratios = measure_int4_tiles()
        start = choose(ratios)
        chosen = {
            "int4_tiles_from": start,
            "tiles_vs_pairs": {str(r): round(v, 3) for r, v in ratios.items()},
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(chosen))
            tmp.replace(path)  # atomic: workers starting together never read half a file
        except OSError as e:
            log.warning("could not cache kernel tuning in %s: %s", path, e)
        log.info("int4 products take AMX tiles from %d rows (tiles / pairs by rows: %s)", start, ratios)
    qgemm.amx_from(start)
    return chosen
