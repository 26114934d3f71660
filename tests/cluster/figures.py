"""The cluster tests' figure per fault, gathered while they run and printed as one table at the end
of the session (tests/cluster/conftest.py), for docs/testing.md.

Per fault: requests that completed with the fault-free output, requests that failed with a clear
error, the time to recover (pd_cluster.recovery_s: from the fault until every stream still running
then moved again) and the KV blocks leaked (held on some worker once all are idle; must be 0)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.utils.cpu import describe


@dataclass
class Row:
    fault: str
    ok: int
    failed: int
    recover_s: float | None  # None: no fault moment (a slow link is slow throughout)
    leaked: int
    note: str = ""


ROWS: list[Row] = []
MODULE_SECONDS: dict[str, float] = {}  # each cluster module's wall time, its cluster's start included


def record(fault: str, ok: int, failed: int, recover_s: float | None, leaked: int, note: str = "") -> None:
    ROWS.append(Row(fault, ok, failed, recover_s, leaked, note))


class timed:
    """Context manager: the wall time of a module's fixture (start, tests, teardown) under `name`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.t0 = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        MODULE_SECONDS[self.name] = time.monotonic() - self.t0


def table() -> list[str]:
    lines = [
        f"cluster faults ({describe()}):",
        "| fault, under streams | identical | failed (clear error) | time to recover | blocks leaked | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        rec = "-" if r.recover_s is None else f"{r.recover_s:.1f} s"
        lines.append(f"| {r.fault} | {r.ok} | {r.failed} | {rec} | {r.leaked} | {r.note} |")
    if MODULE_SECONDS:
        lines.append(
            "run time: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in MODULE_SECONDS.items())
            + f" (total {sum(MODULE_SECONDS.values()):.0f} s)"
        )
    return lines
