"""Prints the cluster tests' figure per fault (tests/cluster/figures.py) as one table after the run."""

from __future__ import annotations

from cluster.figures import ROWS, table


def pytest_terminal_summary(terminalreporter) -> None:
    if ROWS:
        terminalreporter.write_sep("-", "cluster faults")
        for line in table():
            terminalreporter.write_line(line)
