"""Kernel paths chosen by timing them on this machine, once, and cached per CPU model, flags and
kernel build (never assumed per CPU family).

Where int4 products leave one path for the next, on the bfloat16 paths (qgemm_bf16.c): on Intel AMX's
tiles where they run, else on the AVX512-BF16 vector pairs. Each start is measured on one int4
product at a few row counts, one thread, the path starting at the first count from which it is
faster at every count measured:

- from how many rows AMX's exact tiles (the nibbles exact, each group's scale and offset in float32
  after its sums) replace the float32 kernel (qgemm.c). A tile's latency is the same for 1 row as
  for 16 and the float32 kernel's FMAs grow with the rows, so this lies where the core puts it.
- from how many rows the rounded tile (the weight dequantized and rounded to bfloat16, summed over
  all of K in the tile) replaces the exact tiles or pairs. It does more work per weight and none per
  group and row, so it wins from some row count; where depends on the core.
- on AMX, from how many rows int8 products (the output head of an int4 model) take the tiles instead
  of the float32 kernel, for the exact tiles' reason (timed on an int8 product).
- on AMX, from which depth K a prefill's products (from 48 rows) take two output tiles per block of
  16 rows where the rows do not fill a block of 32 (blocks of 32 always take two): each step's
  activations are loaded once for both, but both tiles' pairs are read from L2, which pays at some
  depths and not at others (timed at DEPTHS, PAIR_ROWS rows, on the engine's threads; the same sums).

And below those, on AVX-512 builds: from how many rows int4's float32 register rows (the float32
kernel's 1-8 rows) look their nibbles up in a register instead of converting them. The same floats;
the lookup trades a mask and two conversions for two permutes, which wins or loses by the core's
ports, so it is measured the same way (NO_LUT: off).

And how far ahead a decode step's products of a few rows prefetch their weights (qgemm.prefetch),
which depends on the machine's memory and on the model's shapes too: measure_prefetch times a step
the caller gives (the engine's own model, engine/prefetch_tuning.py) at each distance.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from pdserve.common.paths import cache_root, measuring_alone, save_json
from pdserve.model.kernels import qgemm
from pdserve.model.kernels.native import build
from pdserve.utils.cpu import cpu_flags, cpu_name, feature_key

log = logging.getLogger(__name__)
ROWS = (9, 12, 16, 17, 20, 24, 28)  # AMX: the counts between the bfloat16 rows and the rounded tile's 32
EXACT_ROWS = (1, 2, 3, 4, 6, 8)  # the float32 kernel's counts (qgemm.c's register rows)
NO_EXACT = 9  # qgemm_bf16.c's BF16_ROWS4: where the exact path starts without a measurement
NO_LUT = 9  # qgemm.c's NO_LUT: the register rows' lookup nowhere
SHAPE = (1024, 1024)  # a product small enough to stay in cache: the kernels' arithmetic, not memory
NO_TILES = 32  # qgemm_bf16.c's BF16_ROWS: where the rounded tile starts without a measurement
PAIRS_ROWS = (20, 24, 28, 32, 40, 48, 56)  # the vector pairs: the rounded tile against the exact pairs
NO_ROUNDED = 64  # qgemm_bf16.c's PAIRS_ROUNDED_MAX: the rounded tile faster nowhere measured
PREFETCH_BYTES = (2048, 4096, 8192, 16384)  # the prefetch distances measured
DEPTHS = (576, 1024, 1536, 2048)  # AMX's two tiles a block: the depths timed
NO_TILE_PAIRS = 1 << 20  # qgemm_bf16.c's NO_TILE_PAIRS: one tile a block at every depth
# The product timed at each depth: a block of 32 rows (two tiles either way) and one of 16, the block
# this choice sets.
PAIR_ROWS, PAIR_CHANNELS = 48, 1024
PAIR_TURNS = 7  # alternations at each depth: their ratios' median (the VM's speed drifts)
# Two tiles a block must be this much faster to be chosen: the same sums either way, and a depth near
# 1.0 measured 0.97-1.06 from run to run, so a choice at the noise's edge would flip between loads.
PAIR_GAIN = 0.97
# AMX's tiles against their bits on vector FMAs (qgemm.amx_vectors4_below): the vectors below every count
# measured where the tiles win at none, the tiles from 1 row until measured.
NO_TILES_BELOW, TILES_ONLY = 9, 1
# How long a process waits for another one's measurement (a few products' timings) before measuring.
MEASURE_WAIT_S = 120.0


@dataclass(frozen=True)
class Choice:
    """A row count to measure and set: `key` in the cache, `ratios` the measured ratios' key, `none`
    the start where the path is faster nowhere measured, `unmeasured` the kernel's own start."""

    key: str
    ratios: str
    rows: tuple[int, ...]
    set_start: Callable[[int], None]
    none: int
    unmeasured: int
    mode: str = "int4"  # the weight format timed
    by_depth: bool = False  # `rows` are depths K (PAIR_ROWS rows each), not row counts
    below: float = 1.0  # the ratio a count must beat (choose)
    exact: bool = False  # timed on model.batch_invariant's paths (the exact ones at every row count)


def choices(amx: bool, bf16: bool, lut: bool, vectors: bool = False) -> tuple[Choice, ...]:
    """What is chosen here, each measured against those before it: the register rows' lookup first
    (the exact tiles are measured against the float32 kernel), then the exact path (the rounded tile
    is measured against it). On the vector pairs only the rounded tile's start: the exact pairs ran
    faster than the float32 kernel at 3-8 rows on a Zen 5, alone (in cache and streamed) but not in
    the engine's decode steps (0.93 of the tok/s at 4 streams: benchmarks/kernel_tuning.py), so they
    keep their start of 9 rows. Without bfloat16 products only the lookup. With `vectors` (AMX's tiles'
    bits reproduced on vector FMAs here: qgemm.amx_vectors_agree), below how many rows they replace
    int4's exact tiles and int8's tiles, timed where those run from 1 row (model.batch_invariant)."""
    found = (
        (Choice("int4_lut_from", "lut_vs_convert", EXACT_ROWS, qgemm.lut_from, NO_LUT, NO_LUT),)
        if lut
        else ()
    )
    if not bf16:
        return found
    if amx:
        return (
            *found,
            Choice(
                "int4_exact_from", "exact_vs_float32", EXACT_ROWS, qgemm.amx_exact_from, NO_EXACT, NO_EXACT
            ),
            Choice("int4_tiles_from", "tiles_vs_pairs", ROWS, qgemm.amx_from, NO_TILES, NO_TILES),
            Choice(
                "int8_tiles_from",
                "int8_tiles_vs_float32",
                EXACT_ROWS,
                qgemm.amx8_from,
                NO_EXACT,
                NO_EXACT,
                "int8",
            ),
            Choice(
                "amx_tile_pairs_from_k",
                "tile_pairs_vs_single",
                DEPTHS,
                qgemm.amx_tile_pairs_from,
                NO_TILE_PAIRS,
                NO_TILE_PAIRS,
                by_depth=True,
                below=PAIR_GAIN,
            ),
            *(
                (
                    Choice(
                        "int4_vectors_below",
                        "exact_tiles_vs_vectors",
                        EXACT_ROWS,
                        qgemm.amx_vectors4_below,
                        NO_TILES_BELOW,
                        TILES_ONLY,
                        exact=True,
                    ),
                    Choice(
                        "int8_vectors_below",
                        "int8_tiles_vs_vectors",
                        EXACT_ROWS,
                        qgemm.amx_vectors8_below,
                        NO_TILES_BELOW,
                        TILES_ONLY,
                        "int8",
                        exact=True,
                    ),
                )
                if vectors
                else ()
            ),
        )
    return (
        *found,
        Choice(
            "int4_rounded_from",
            "rounded_vs_pairs",
            PAIRS_ROWS,
            qgemm.pairs_rounded_from,
            NO_ROUNDED,
            NO_TILES,
        ),
    )


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


def _ratio(fn, set_start, start: int, off: int, turns: int = 1) -> float:
    """fn's time with set_start(start) over its time with set_start(off) (below 1 the path is faster),
    the median of `turns` alternations."""
    each = []
    for _ in range(turns):
        times = []
        for s in (start, off):
            set_start(s)
            times.append(best_time(fn))
        each.append(times[0] / times[1])
    return statistics.median(each)


@contextmanager
def _row_count_paths(set_start, off: int, threads: int | None = None, exact_to: int = 0):
    """While timing: model.batch_invariant's bound lifted (the row-count paths are what is measured),
    or set to `exact_to` rows (the exact paths to that count), and, given `threads`, torch's thread
    count set; after, both restored and the path left off."""
    saved_threads, invariant = torch.get_num_threads(), qgemm.invariant_bound()
    if threads is not None:
        torch.set_num_threads(threads)
    qgemm.invariant_rows(exact_to)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        qgemm.invariant_rows(invariant)
        set_start(off)


def _ratios(
    rows_list: tuple[int, ...], set_start, off: int, mode: str = "int4", exact: bool = False
) -> dict[int, float]:
    """Per row count: the product's time (a `mode` weight, one thread) with the path starting there
    (set_start(rows)) over its time with the path off (set_start(off)); below 1 the path is faster.
    `exact`: on model.batch_invariant's paths."""
    from pdserve.model.linear import linear
    from pdserve.model.quant import QuantizedWeight, quantize

    g = torch.Generator().manual_seed(0)
    qw = QuantizedWeight(quantize(torch.randn(*SHAPE, generator=g) * 0.05, mode), native=True)
    ratios = {}
    with _row_count_paths(set_start, off, threads=1, exact_to=max(rows_list) if exact else 0):
        for rows in rows_list:
            x = torch.randn(rows, SHAPE[1], generator=g)
            ratios[rows] = _ratio(lambda: linear(x, qw), set_start, rows, off)
    return ratios


def _depth_ratios(depths: tuple[int, ...], set_start, off: int) -> dict[int, float]:
    """Per depth K: an int4 product's time (PAIR_ROWS x K by PAIR_CHANNELS) with the path starting at
    K over its time with it off, the median of PAIR_TURNS alternations. On the threads the engine runs
    (torch's count now): whether two tiles' pairs read from L2 pay depends on the cores sharing the
    caches, not on the arithmetic alone."""
    from pdserve.model.linear import linear
    from pdserve.model.quant import QuantizedWeight, quantize

    g = torch.Generator().manual_seed(0)
    ratios = {}
    with _row_count_paths(set_start, off):
        for k in depths:
            qw = QuantizedWeight(
                quantize(torch.randn(PAIR_CHANNELS, k, generator=g) * 0.05, "int4"), native=True
            )
            x = torch.randn(PAIR_ROWS, k, generator=g)
            ratios[k] = _ratio(lambda: linear(x, qw), set_start, k, off, PAIR_TURNS)
    return ratios


def measure(choice: Choice) -> dict[int, float]:
    """Per row count (or depth): the product's time with the choice's path starting there over its
    time without (below 1: faster)."""
    if choice.by_depth:
        return _depth_ratios(choice.rows, choice.set_start, choice.none)
    return _ratios(choice.rows, choice.set_start, choice.none, choice.mode, choice.exact)


def choose(ratios: dict[int, float], none: int = NO_TILES, below: float = 1.0) -> int:
    """The first row count from which the path is faster (its ratio under `below`) at every count
    measured (`none`: nowhere)."""
    start = none
    for rows in sorted(ratios, reverse=True):
        if ratios[rows] >= below:
            break
        start = rows
    return start


def measure_prefetch(step: Callable[[], None], rounds: int = 5) -> dict[int, float]:
    """Per prefetch distance (bytes): the fastest of `rounds` timings of `step` (a decode step). The
    distances take turns within each round, as the VM's memory speed drifts from second to second;
    after each change one step runs untimed (its first loads were asked for at the old distance)."""
    before = qgemm.prefetch_bytes()
    best = dict.fromkeys(PREFETCH_BYTES, float("inf"))
    n = len(PREFETCH_BYTES)
    try:
        step()
        for r in range(rounds):
            for nbytes in PREFETCH_BYTES[r % n :] + PREFETCH_BYTES[: r % n]:
                qgemm.prefetch(nbytes)
                step()
                t0 = time.perf_counter()
                step()
                best[nbytes] = min(best[nbytes], time.perf_counter() - t0)
    finally:
        qgemm.prefetch(before)
    return best


def choose_prefetch(seconds: dict[int, float], within: float = 0.02) -> int:
    """The shortest distance within `within` of the fastest: prefetching farther than pays only risks
    evicting lines still to be read."""
    fastest = min(seconds.values())
    return min(b for b, t in seconds.items() if t <= fastest * (1 + within))


def _cache_path() -> Path:
    build_id = build("qgemm").stem  # its name holds the feature set and the sources' digest
    model = "".join(c if c.isalnum() else "-" for c in cpu_name())[:60]
    return cache_root() / "kernels" / f"tuning-{model}-{feature_key()}-{build_id[-16:]}.json"


def machine_choices() -> tuple[Choice, ...]:
    """The choices this machine's build offers (none where the kernels do not load here)."""
    if not qgemm.available():
        return ()
    bf16 = "avx512_bf16" in cpu_flags() and qgemm.bf16_rows("int4") > 0
    amx = bf16 and "amx_tile" in cpu_flags() and qgemm.amx()
    return choices(amx, bf16, qgemm.has_lut(), amx and qgemm.amx_vectors_agree())


def _cached(path: Path, chosen_paths: tuple[Choice, ...]) -> tuple[dict, list[int]] | None:
    """The choices cached at `path` and their starts (None where none are cached or readable)."""
    try:
        chosen = json.loads(path.read_text())
        return chosen, [int(chosen[c.key]) for c in chosen_paths]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable kernel tuning %s: %s", path, e)
        return None


@lru_cache(maxsize=1)
def tune() -> dict:
    """Apply this machine's measured choices (measured now and cached where none are cached yet);
    returns them ({} where there is nothing to choose: neither bfloat16 products nor the lookup).
    Processes starting together measure in turn (the later ones read the first one's choices): a
    deployment's workers on one machine then take the same paths, so a row computes the same bits in
    each (a prefill worker's and a decode worker's, say), and no measurement runs beside another."""
    chosen_paths = machine_choices()
    if not chosen_paths:
        return {}
    path = _cache_path()
    found = _cached(path, chosen_paths)
    if found is None:
        with measuring_alone(path, "the kernel tuning", MEASURE_WAIT_S):
            found = _cached(path, chosen_paths)  # measured by another process meanwhile
            if found is None:
                found = _measure_all(chosen_paths)
                save_json(path, found[0], "kernel tuning")
                log.info("int4 kernel paths measured on this machine: %s", found[0])
    chosen, starts = found
    for c, start in zip(chosen_paths, starts, strict=True):
        c.set_start(start)
    return chosen


def _measure_all(chosen_paths: tuple[Choice, ...]) -> tuple[dict, list[int]]:
    """Each choice measured (against those before it, already set) and chosen: what the cache holds
    (starts and ratios) and the starts."""
    chosen: dict = {}
    starts = []
    for c in chosen_paths:
        ratios = measure(c)
        start = choose(ratios, c.none, c.below)
        c.set_start(start)  # the next choice is measured against this one
        chosen[c.key] = start
        chosen[c.ratios] = {str(r): round(v, 3) for r, v in ratios.items()}
        starts.append(start)
    return chosen, starts
