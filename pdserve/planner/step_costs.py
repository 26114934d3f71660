"""A machine's measured step costs (what `pdserve profile` writes) and the cost model read from them.

Torch-free on purpose: the planner's simulator (planner/pd_simulate.py) reads it without loading a
model. The figures are raw measurements on grids; between grid points the model interpolates
linearly, and beyond them it extrapolates from the last two points, so a plan for a longer context
than was profiled degrades gracefully instead of failing.

Units: seconds, tokens, bytes.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT = "pdserve-profile/1"


class ProfileError(ValueError):
    """A profile file that is missing, unreadable or not of this format."""


@dataclass(frozen=True)
class Grid:
    """Step seconds measured at every (row, column): rows and columns ascending."""

    rows: list[int]  # prefill: chunk tokens; decode: batch size
    cols: list[int]  # context tokens already in the KV cache (per sequence)
    seconds: list[list[float]]  # seconds[i][j] at (rows[i], cols[j])

    def check(self, name: str) -> None:
        if not self.rows or not self.cols:
            raise ProfileError(f"{name}: an empty grid")
        if sorted(set(self.rows)) != self.rows or sorted(set(self.cols)) != self.cols:
            raise ProfileError(f"{name}: rows and columns must be strictly ascending")
        if len(self.seconds) != len(self.rows) or any(len(r) != len(self.cols) for r in self.seconds):
            raise ProfileError(
                f"{name}: seconds must have one row per row value and one column per column value"
            )
        if any(not (isinstance(s, (int, float)) and s > 0) for r in self.seconds for s in r):
            raise ProfileError(f"{name}: every time must be a positive number of seconds")

    def scaled(self, factor: float) -> Grid:
        """Every time multiplied by `factor` (the profile's grids rescaled to served steps)."""
        return Grid(list(self.rows), list(self.cols), [[v * factor for v in r] for r in self.seconds])

    def at(self, row: float, col: float) -> float:
        """Bilinear interpolation (linear extrapolation past the edges), never below 10% of the
        smallest measured time: an extrapolated step still costs something."""

        def lerp_axis(axis: list[int], x: float) -> tuple[int, int, float]:
            if len(axis) == 1:
                return 0, 0, 0.0
            i = min(max(bisect_right(axis, x) - 1, 0), len(axis) - 2)
            return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])

        i0, i1, fr = lerp_axis(self.rows, row)
        j0, j1, fc = lerp_axis(self.cols, col)
        s = self.seconds

        def row_at(i: int) -> float:
            return s[i][j0] + (s[i][j1] - s[i][j0]) * fc

        v = row_at(i0) + (row_at(i1) - row_at(i0)) * fr
        return max(v, 0.1 * min(min(r) for r in s))


@dataclass(frozen=True)
class Serving:
    """What serving adds to the engine's steps, measured on an idle deployment (planner/serving.py):
    per-request time outside the steps (HTTP, the router, the PD handshake, streaming) and the time a
    served step takes beyond the same step timed alone (the worker's event loop, streaming each token)."""

    pd_local_overhead_s: float  # TTFT beyond the steps, prompt prefilled by the decode worker
    pd_remote_overhead_s: float  # TTFT beyond the steps and exposed transfer, prompt from a prefill worker
    pd_step_s: float  # added to every step of a PD deployment's workers
    mixed_overhead_s: float  # a mixed server (no router)
    mixed_step_s: float
    # A PD decode worker's step ÷ the grid's where no other worker is busy: it borrows their idle cores
    # (the PD deployment's served batch-1 step ÷ the mixed server's, which has none to borrow; the grids
    # are scaled to the latter). 1.0 in profiles taken before it was measured.
    pd_decode_lent: float = 1.0
    # The same for a PD worker's steps with prompt tokens (a prefill worker's, a decode worker's local
    # prompts). 1.0 in profiles taken before it was measured.
    pd_prefill_lent: float = 1.0


@dataclass(frozen=True)
class StepCosts:
    """What one worker's engine step costs on one machine, for one model and engine setting."""

    cpu: str  # pdserve.utils.cpu.describe()
    cores: int  # cores this process could use when profiled
    model: str
    dtype: str
    quantization: str
    threads: int  # torch threads of the profiled engine (a worker's)
    block_size: int
    num_layers: int
    kv_bytes_per_token: int  # K and V of every layer
    prefill: Grid  # one step prefilling `row` prompt tokens of one request at context `col`
    decode: Grid  # one step decoding `row` requests, each at context `col`
    transport: str  # the KV transport measured (shm or tcp)
    transfer_bytes: list[int]  # KV moved in one transfer ...
    transfer_seconds: list[float]  # ... and how long it took
    layerwise: bool = True  # transfer.layerwise when profiled: all but one layer's bytes overlap compute
    serving: Serving | None = None  # None: not measured (pdserve profile --no-serving)
    # A step's time while another worker computes on another core / alone (planner/contention.py).
    contended_decode: float = 1.0
    contended_prefill: float = 1.0
    created: str = ""
    format: str = FORMAT
    notes: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ the cost model

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        return self.prefill.at(tokens, context)

    def decode_s(self, batch: int, context: int) -> float:
        return self.decode.at(batch, context)

    def step_s(
        self, decode_batch: int, decode_context: float, prefill_tokens: int, prefill_context: float
    ) -> float:
        """One engine step running `decode_batch` decoding requests (mean context `decode_context`)
        and `prefill_tokens` prompt tokens (mean context before them `prefill_context`) together.
        A mixed step is one forward over all its tokens, so the linear layers cost what a prefill
        of that many tokens costs; the decoders' attention over their contexts comes on top."""
        if prefill_tokens <= 0:
            return self.decode_s(decode_batch, round(decode_context)) if decode_batch else 0.0
        t = self.prefill_s(prefill_tokens + decode_batch, round(prefill_context))
        if decode_batch:
            c0 = self.decode.cols[0]
            t += max(
                0.0, self.decode_s(decode_batch, round(decode_context)) - self.decode_s(decode_batch, c0)
            )
        return t

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move nbytes of KV (linear through the measured points: latency + bytes / bandwidth)."""
        xs, ys = self.transfer_bytes, self.transfer_seconds
        if len(xs) == 1:
            return ys[0] * nbytes / xs[0]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return max(0.0, my - slope * mx) + max(slope, 0.0) * nbytes

    def exposed_transfer_s(self, tokens: int) -> float:
        """The part of a prompt's KV transfer that follows its last forward: layer by layer, only the
        last layer's share (the rest went out while later layers computed); else all of it."""
        t = self.transfer_s(tokens * self.kv_bytes_per_token)
        return t / self.num_layers if self.layerwise else t

    # ------------------------------------------------------------------ the file

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Any) -> "StepCosts":
        if not isinstance(data, dict):
            raise ProfileError("a profile is a JSON object")
        if data.get("format") != FORMAT:
            raise ProfileError(f"not a profile of format {FORMAT!r} (format: {data.get('format')!r})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ProfileError(f"unknown keys {unknown}")
        try:
            kw = dict(data)
            for g in ("prefill", "decode"):
                kw[g] = Grid(**kw[g])
            if kw.get("serving") is not None:
                kw["serving"] = Serving(**kw["serving"])
            costs = cls(**kw)
        except (TypeError, KeyError) as e:
            raise ProfileError(f"malformed profile: {e}") from None
        costs.check()
        return costs

    def check(self) -> None:
        self.prefill.check("prefill")
        self.decode.check("decode")
        if not self.transfer_bytes or len(self.transfer_bytes) != len(self.transfer_seconds):
            raise ProfileError("transfer_bytes and transfer_seconds must be equally long and not empty")
        if any(b <= 0 for b in self.transfer_bytes) or any(s <= 0 for s in self.transfer_seconds):
            raise ProfileError("transfer sizes and times must be positive")
        if self.serving is not None and not all(
            isinstance(v, (int, float)) for v in asdict(self.serving).values()
        ):
            raise ProfileError("serving figures must be numbers of seconds")
        if not (
            isinstance(self.contended_decode, (int, float))
            and isinstance(self.contended_prefill, (int, float))
            and self.contended_decode >= 1.0
            and self.contended_prefill >= 1.0
        ):
            raise ProfileError("contended_decode and contended_prefill must be numbers >= 1")
        for name in ("cores", "threads", "block_size", "num_layers", "kv_bytes_per_token"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ProfileError(f"{name} must be a positive integer, not {v!r}")

    @classmethod
    def load(cls, path: str | Path) -> "StepCosts":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ProfileError(f"cannot read {path}: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON: {e}") from None
        return cls.from_dict(data)
