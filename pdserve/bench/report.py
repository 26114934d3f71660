"""Human-readable output: rich tables for the terminal and markdown for files."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

_LAT = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def _f(x: float, nd: int = 1) -> str:
    return f"{x:,.{nd}f}"


def summary_table(s: dict, title: str = "pdserve bench") -> Table:
    """One run: totals and throughputs, then the latency distributions."""
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("completed / failed", f"{s['completed']} / {s['failed']}")
    t.add_row("duration (s)", _f(s["duration_s"], 2))
    t.add_row("input / output tokens", f"{s['input_tokens']:,} / {s['output_tokens']:,}")
    t.add_row("requests/s", _f(s["request_throughput"], 3))
    t.add_row("output tok/s", _f(s["output_throughput_tok_s"]))
    t.add_row("total tok/s", _f(s["total_throughput_tok_s"]))
    t.add_row(
        "per-user tok/s (mean / p50)", f"{_f(s['per_user_tok_s']['mean'])} / {_f(s['per_user_tok_s']['p50'])}"
    )
    if "goodput_req_s" in s:
        t.add_row(f"goodput req/s ({s['slo']['met']} met SLO)", _f(s["goodput_req_s"], 3))
    for kind, n in sorted(s["errors"].items()):
        t.add_row(f"[red]error: {kind}[/red]", str(n))
    if s.get("usage_missing"):
        t.add_row("[yellow]replies without usage[/yellow]", str(s["usage_missing"]))
    return t


def latency_table(s: dict, title: str = "latency (ms)") -> Table:
    t = Table(title=title, header_style="bold")
    for c in ("", "mean", "p50", "p90", "p99"):
        t.add_column(c, justify="right" if c else "left")
    rows = [("", s)] + [(f"[{tag}] ", b) for tag, b in (s.get("by_tag") or {}).items()]
    for prefix, block in rows:
        for name, key in _LAT:
            d = block[key]
            t.add_row(prefix + name, *(_f(d[k]) for k in ("mean", "p50", "p90", "p99")))
    return t


def sweep_table(points: list[dict]) -> Table:
    """A concurrency sweep: each row one level, the throughput-versus-experience curve in numbers."""
    # Short headers: the table must stay readable in an 80-column terminal or CI log.
    t = Table(title="concurrency sweep (latencies in ms)", header_style="bold")
    for c in (
        "conc",
        "ok/fail",
        "out tok/s",
        "total tok/s",
        "user tok/s",
        "TTFT p50",
        "TPOT p50",
        "TPOT p99",
    ):
        t.add_column(c, justify="right")
    for p in points:
        t.add_row(
            str(p["concurrency"]),
            f"{p['completed']}/{p['failed']}",
            _f(p["output_throughput_tok_s"]),
            _f(p["total_throughput_tok_s"]),
            _f(p["per_user_tok_s"]["p50"]),
            _f(p["ttft_ms"]["p50"]),
            _f(p["tpot_ms"]["p50"]),
            _f(p["tpot_ms"]["p99"]),
        )
    return t


def print_run(s: dict, console: Console | None = None, title: str = "pdserve bench") -> None:
    console = console or Console()
    console.print(summary_table(s, title))
    console.print(latency_table(s))


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; numbers are printed as given, so format them before."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
