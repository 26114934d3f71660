"""What a decode step costs on this machine by its number of rows, measured, not assumed.

Speculative decoding (engine/spec_policy.py) asks what the rows of a draft add to a step. That
depends on the CPU, the kernels the build chose, the weights' format and the thread count far
more than on the model's size: one quantized row more can cost nearly nothing or nearly a whole
step. So the engine measures it: a short calibration when it starts (decode rows through the model
at a few row counts, on KV blocks borrowed from its own pool and returned), cached per CPU, model,
format and threads, so a later start reads it back. While serving, every decode-only step's wall
time corrects the calibration's fixed part (scheduling and sampling, which the calibration does
not run), so the costs follow the machine as it is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from bisect import bisect_right
from pathlib import Path
from typing import Any

import torch

from pdserve.common.paths import cache_root, save_json
from pdserve.model.attention import build_metadata
from pdserve.model.kernels.argmax import argmax_rows
from pdserve.utils.cpu import cpu_flags, cpu_name

log = logging.getLogger(__name__)

FORMAT = "pdserve-row-costs/2"  # 2: each count its fastest of several sweeps (1 kept a disturbed median)
# The weight of a new step's observed overhead in the running estimate.
OVERHEAD_EMA = 0.1


def calibration_rows(max_rows: int) -> list[int]:
    """Row counts to time: every one up to 8 (where kernels change paths), then about 1.5x apart."""
    out, r = [], 1
    while r <= max_rows:
        out.append(r)
        r = r + 1 if r < 8 else int(r * 1.5)
    if out[-1] != max_rows:
        out.append(max_rows)
    return out


class RowCosts:
    """Seconds of a decode step by rows: the calibration's table, interpolated linearly (extrapolated
    from its last two points), plus the overhead learned from served steps."""

    def __init__(self, rows: list[int], seconds: list[float]) -> None:
        if not rows or len(rows) != len(seconds) or sorted(set(rows)) != rows:
            raise ValueError("row costs need strictly ascending row counts, one time each")
        self.rows = rows
        # Never cheaper for more rows: a dip in the measurement must not make drafting look free.
        self.seconds = [max(seconds[: i + 1]) for i in range(len(seconds))]
        self.overhead = 0.0

    def measured(self, rows: int) -> float:
        r, s = self.rows, self.seconds
        if len(r) == 1:
            return s[0] * rows / r[0]
        i = min(max(bisect_right(r, rows) - 1, 0), len(r) - 2)
        t = s[i] + (s[i + 1] - s[i]) * (rows - r[i]) / (r[i + 1] - r[i])
        return max(t, s[0])

    def __call__(self, rows: int) -> float:
        return self.measured(rows) + self.overhead

    def observe(self, rows: int, seconds: float) -> None:
        """A served decode-only step of `rows` rows took `seconds`, wall time."""
        extra = max(0.0, seconds - self.measured(rows))
        self.overhead += OVERHEAD_EMA * (extra - self.overhead)


def _kernels_digest() -> str:
    """The native kernels' sources: another build times differently."""
    h = hashlib.sha256()
    for f in sorted((Path(__file__).resolve().parents[1] / "model" / "kernels").glob("*.[ch]")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def cache_key(parts: dict[str, Any]) -> str:
    """What the costs depend on: the CPU, the model and its format, the threads, the build."""
    full = {
        "format": FORMAT,
        "cpu": cpu_name(),
        "flags": sorted(cpu_flags()),
        "kernels": _kernels_digest(),
        **parts,
    }
    return hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]


def cache_path(key: str) -> Path:
    return cache_root() / "row-costs" / f"{key}.json"


def load_cached(key: str) -> RowCosts | None:
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        return RowCosts([int(r) for r in data["rows"]], [float(s) for s in data["seconds"]])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable row costs %s: %s", path, e)
        return None


def save_cached(key: str, costs: RowCosts) -> None:
    save_json(cache_path(key), {"format": FORMAT, "rows": costs.rows, "seconds": costs.seconds}, "row costs")


def decode_step(
    model, kv_cache: torch.Tensor, blocks: list[int], block_size: int, rows: int, context: int, gen
):
    """One decode step of `rows` rows at `context` tokens each, as a call. Every row attends to the same
    borrowed blocks and writes the same slot (their contents are garbage, never read by a request:
    the caller returns the blocks to the pool unhashed)."""
    meta = build_metadata([(blocks, context, 1)] * rows, block_size, model.arch.sliding_window, model.device)
    ids = torch.randint(0, model.arch.vocab_size, (rows,), generator=gen).to(model.device)
    positions = torch.full((rows,), context, dtype=torch.long, device=model.device)
    logits_rows = torch.arange(rows, device=model.device)

    @torch.inference_mode()
    def run() -> None:
        argmax_rows(model.forward(ids, positions, meta, kv_cache, logits_rows))  # as the sampler picks

    return run


def context_blocks(context: int, block_size: int) -> int:
    """Blocks a decode row at `context` tokens attends to, its own slot included."""
    return (context + block_size) // block_size


# Sweeps over the row counts, each timing every count twice: a count's cost is its fastest time.
PASSES = 3


@torch.inference_mode()
def calibrate(model, kv_cache: torch.Tensor, pool, block_size: int, max_rows: int, context: int) -> RowCosts:
    """Times decode steps of 1..max_rows rows at `context` tokens each, on blocks borrowed from the pool.
    Other work on the host (a worker starting beside this one) only ever adds time, and a cost too
    high for one count is carried to every larger count (RowCosts never falls): so each count is
    timed in several sweeps, a disturbance rarely lasting through all of them, and its fastest time
    is its cost."""
    blocks = pool.allocate(context_blocks(context, block_size))
    try:
        rows_list = calibration_rows(max_rows)
        gen = torch.Generator().manual_seed(0)
        steps = [decode_step(model, kv_cache, blocks, block_size, rows, context, gen) for rows in rows_list]
        for step in steps:  # the first runs cold
            step()
        best = [float("inf")] * len(steps)
        for _ in range(PASSES):
            for i, step in enumerate(steps):
                for _ in range(2):
                    t0 = time.perf_counter()
                    step()
                    best[i] = min(best[i], time.perf_counter() - t0)
        return RowCosts(rows_list, best)
    finally:
        pool.free(blocks)
