"""`pdserve bench`: argument parsing and the run/sweep driver. Entry point: main(argv) -> int."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import report
from .client import ClientConfig, run_load
from .metrics import RequestRecord, summarize
from .workloads import SYNTHETIC, Session, count_requests, make_workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Load an OpenAI-compatible server with a workload and report throughput "
        "and latency (TTFT, TPOT, ITL, end-to-end, per-user tok/s).",
    )
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root or its /v1 URL (default %(default)s)"
    )
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--model", default=None, help="model name; default: the first in /v1/models")
    p.add_argument(
        "--api",
        choices=("chat", "completions"),
        default="chat",
        help="endpoint for single-turn requests (conversations always use chat)",
    )
    p.add_argument(
        "--workload",
        default="chat",
        help=f"one of {', '.join(SYNTHETIC)}, or a .jsonl file (see docs/bench.md)",
    )
    p.add_argument(
        "--num-requests", "-n", type=int, default=64, help="requests in total (turns, for conversations)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--concurrency",
        "-c",
        type=int,
        default=None,
        help="closed loop with this many sessions in flight (default 8)",
    )
    g.add_argument(
        "--request-rate",
        "-r",
        type=float,
        default=None,
        help="Poisson arrivals at this many sessions per second (open loop)",
    )
    g.add_argument(
        "--sweep-concurrency",
        default=None,
        metavar="C1,C2,...",
        help="one closed-loop run per level; plots throughput vs per-user tok/s",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="with --request-rate: cap on sessions in flight"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="every request's max_tokens (default: drawn by the workload)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt words for --workload fixed")
    p.add_argument(
        "--ignore-eos", action="store_true", help="ask the server to generate max_tokens regardless of EOS"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take before it counts as a timeout",
    )
    p.add_argument("--output-json", default=None, metavar="F")
    p.add_argument(
        "--save-requests",
        action="store_true",
        help="include every request's record (timestamps, tokens, error) in the JSON",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="F.png",
        help="latency CDFs for a run; the trade-off curve for a sweep",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def run_once(
    cfg: ClientConfig,
    sessions: list[Session],
    *,
    concurrency: int | None,
    request_rate: float | None,
    seed: int,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    show_progress: bool = False,
    console: Console | None = None,
    label: str = "requests",
) -> tuple[dict, list[RequestRecord]]:
    """One benchmark run with a progress bar; returns (summary, records)."""
    total = count_requests(sessions)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress,
        transient=True,
    ) as prog:
        task = prog.add_task(label, total=total, failed=0)
        finished: list[RequestRecord] = []
        failed = 0

        def on_done(r: RequestRecord) -> None:
            nonlocal failed
            finished.append(r)
            failed += not r.ok
            prog.update(task, advance=1, failed=failed)

        t0 = time.perf_counter()
        interrupted = False
        try:
            records, duration = asyncio.run(
                run_load(
                    cfg,
                    sessions,
                    concurrency=concurrency,
                    request_rate=request_rate,
                    seed=seed,
                    on_done=on_done,
                )
            )
        except KeyboardInterrupt:
            # Ctrl-C: report what finished so far rather than lose a long run; the requests
            # in flight are left out, and `interrupted` says the counts fall short of N.
            interrupted = True
            records = finished
            ends = [r.end for r in finished if r.end is not None]
            duration = max(ends) - t0 if ends else 0.0
    s = summarize(records, duration, slo_ttft_ms, slo_tpot_ms)
    s["interrupted"] = interrupted
    s["num_requests"] = total
    s["concurrency"] = concurrency
    s["request_rate"] = request_rate
    return s, records


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when the run finished and at least one request completed, 1 when none did
    (the report still prints: errors are counted, never raised), 2 on bad arguments, 130 when
    Ctrl-C cut the run short (the report covers what finished)."""
    p = build_parser()
    a = p.parse_args(argv)
    console = Console(stderr=False)
    if a.num_requests <= 0:
        p.error("--num-requests must be positive")
    for name in ("concurrency", "max_concurrency"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if a.request_rate is not None and a.request_rate <= 0:
        p.error("--request-rate must be positive")
    if a.workload not in SYNTHETIC and not Path(a.workload).is_file():
        p.error(f"--workload: {a.workload!r} is neither a known workload nor a file")
    cfg = ClientConfig(
        base_url=a.base_url,
        model=a.model,
        api_key=a.api_key,
        api=a.api,
        ignore_eos=a.ignore_eos,
        temperature=a.temperature,
        request_timeout_s=a.request_timeout,
    )

    def workload(level: int = 0) -> list:
        # A sweep's levels each draw their own synthetic requests (seed + level index): the server's
        # prefix cache keeps the last level's, and the same prompts again would be cache hits. A
        # JSONL file is what it is: every level sends it (docs/bench.md).
        return make_workload(
            a.workload, a.num_requests, seed=a.seed + level, max_tokens=a.max_tokens, input_len=a.input_len
        )

    try:
        sessions = workload()
    except (ValueError, OSError) as e:  # a malformed JSONL file is a usage error
        p.error(f"--workload: {e}")
    common = dict(
        seed=a.seed,
        slo_ttft_ms=a.slo_ttft_ms,
        slo_tpot_ms=a.slo_tpot_ms,
        show_progress=not a.no_progress and console.is_terminal,
        console=console,
    )
    config = {k: v for k, v in vars(a).items() if k not in ("api_key", "no_progress")}
    if a.sweep_concurrency:
        try:
            levels = [int(x) for x in a.sweep_concurrency.split(",") if x.strip()]
        except ValueError:
            p.error("--sweep-concurrency takes integers, e.g. 1,2,4,8")
        if not levels or min(levels) <= 0:
            p.error("--sweep-concurrency takes positive integers")
        points = []
        for i, c in enumerate(levels):
            s, _ = run_once(
                cfg,
                workload(i) if i else sessions,
                concurrency=c,
                request_rate=None,
                label=f"concurrency {c}",
                **common,
            )
            points.append(s)
            console.print(
                f"concurrency {c}: {s['output_throughput_tok_s']:.1f} out tok/s, "
                f"{s['per_user_tok_s']['p50']:.1f} tok/s per user, "
                f"{s['completed']} done, {s['failed']} failed"
            )
            if s["interrupted"]:
                break
        console.print(report.sweep_table(points))
        out: dict = {"config": config, "sweep": points}
        if a.plot:
            from .plot import plot_tradeoff

            plot_tradeoff(
                {a.model or "server": points}, a.plot, title=f"{a.workload}: throughput vs per-user speed"
            )
            console.print(f"plot written to {a.plot}")
        ok = any(pt["completed"] for pt in points)
        interrupted = points[-1]["interrupted"]
    else:
        conc = a.concurrency if a.request_rate is None else a.max_concurrency
        if a.request_rate is None and conc is None:
            conc = 8
        s, records = run_once(cfg, sessions, concurrency=conc, request_rate=a.request_rate, **common)
        report.print_run(s, console, title=f"pdserve bench: {a.workload}")
        out = dict(s)
        out["config"] = config
        if a.save_requests:
            out["requests"] = [r.to_dict() for r in records]
        if a.plot:
            from .plot import plot_run

            plot_run(records, a.plot, title=f"{a.workload}, {s['completed']} requests")
            console.print(f"plot written to {a.plot}")
        ok = s["completed"] > 0
        interrupted = s["interrupted"]
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"JSON written to {a.output_json}")
    if interrupted:
        console.print("[yellow]interrupted: the figures cover the requests finished before it")
        return 130  # the shell's code for SIGINT
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
