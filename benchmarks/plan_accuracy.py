"""The planner's predictions against measurement: TTFT p50/p90 and TPOT p50 predicted by the PD
simulator (pdserve plan's, planner/pd_simulate.py) on this machine's profile (pdserve profile), and
measured on real `pdserve serve` deployments driven by the pdserve bench client with the same
requests at the same Poisson arrivals. Prints, per deployment and workload, predicted / measured
for each figure (the goal: within 20%, i.e. 0.8-1.2), and one JSON line with everything and the
CPU.

Each cell runs `--rounds` times on its server, the workloads taking turns, each round with requests
of its own (seed + round: no prefix-cache hit on an earlier round's prompts, which the planner does
not model); a cell's figure is the median round's ratio. A 2-core VM's speed can move 2x for a
minute (the same server and workload measured TPOT p50 8.3 and 27.5 ms minutes apart), which one
round reads as the planner's error.

Deployments (each worker with the profile's threads: a decode worker's, one unless its config says):
  1P1D      pdserve serve --prefill 1 --decode 1 (router + 2 workers), prefill chunk 512
  1P1D-c128 the same with the prefill worker's max_num_batched_tokens 128
  mixed     pdserve serve --mode mixed --threads T (one process, no router)
Workloads (the completions API, ignore_eos so each reply is its max_tokens):
  chat      bench's chat workload (prompts median ~130 tokens), replies of 32 tokens
  gen       bench's fixed workload: 32-token prompts (prefilled by the decode worker), replies of 64

Run under the exclusive lock, one deployment at a time if the whole takes too long:
  flock -x /tmp/bench.lock .venv/bin/python benchmarks/plan_accuracy.py --profile prof.json --deployments 1P1D
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

import yaml

from pdserve.bench.client import ClientConfig, run_load
from pdserve.bench.metrics import percentile
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.bench.workloads import Session, Turn, make_workload
from pdserve.planner.pd_simulate import PDFleet, RoleSettings
from pdserve.planner.search import predict, workload_requests
from pdserve.planner.step_costs import StepCosts
from pdserve.utils.cpu import describe

DEPLOYMENTS = {"1P1D": (1, 1, 512), "1P1D-c128": (1, 1, 128), "mixed": (0, 0, 512)}
# name -> (bench workload, input_len, max_tokens, rate req/s)
WORKLOADS = {"chat": ("chat", 128, 32, 0.35), "gen": ("fixed", 32, 64, 0.4)}


def fleet_of(name: str, costs: StepCosts) -> PDFleet:
    p, d, chunk = DEPLOYMENTS[name]
    common = dict(
        decode_settings=RoleSettings(64, 512),
        threads=costs.threads,
        cores=costs.cores,
        block_size=costs.block_size,
    )
    if name == "mixed":
        return PDFleet(prefill=0, decode=0, mixed=1, **common)  # type: ignore[arg-type]
    return PDFleet(prefill=p, decode=d, prefill_settings=RoleSettings(64, chunk), **common)  # type: ignore[arg-type]


def start(name: str, model: str, threads: int, tmp: Path) -> ServerProcess:
    p, d, chunk = DEPLOYMENTS[name]
    port = free_port()
    cfg = {
        "deployment": {
            "prefill": {"max_num_batched_tokens": chunk, "threads": threads},
            "decode": {"threads": threads},
        }
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = pdserve_cmd() + [
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--config",
        str(path),
        "--max-model-len",
        "2048",
    ]
    cmd += (
        ["--mode", "mixed", "--threads", str(threads)]
        if name == "mixed"
        else ["--prefill", str(p), "--decode", str(d)]
    )
    return ServerProcess(cmd, port, tmp / f"{name}.log")


def measured(url: str, workload: str, n: int, seed: int) -> dict:
    wl, input_len, max_tokens, rate = WORKLOADS[workload]
    sessions = make_workload(wl, n, seed=seed, max_tokens=max_tokens, input_len=input_len)
    cfg = ClientConfig(url, api="completions", ignore_eos=True)
    # Warm up: the first requests of a fresh process pay its allocations.
    asyncio.run(run_load(cfg, [Session(0, [Turn("hello " * 80, 4)]), Session(1, [Turn("hello there", 8)])]))
    load_before = os.getloadavg()[0]
    records, _ = asyncio.run(run_load(cfg, sessions, request_rate=rate, seed=seed))
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "tpot_p50": percentile(tpot, 50),
        "prompt_tokens_mean": sum(r.prompt_tokens or 0 for r in ok) / max(1, len(ok)),
        "loadavg": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }


def predicted(costs: StepCosts, deployment: str, workload: str, n: int, seed: int) -> dict:
    wl, input_len, max_tokens, rate = WORKLOADS[workload]
    reqs = workload_requests(wl, n, rate, seed, max_tokens, input_len)
    p = predict(costs, fleet_of(deployment, costs), reqs)
    return {
        "ttft_p50": p.ttft_p50_s,
        "ttft_p90": p.ttft_p90_s,
        "tpot_p50": p.tpot_p50_s,
        "prompt_tokens_mean": sum(r.prompt_tokens for r in reqs) / len(reqs),
    }


FIGURES = ("ttft_p50", "ttft_p90", "tpot_p50")


def _ratios(pred: dict, meas: dict) -> dict[str, float]:
    return {k: round(pred[k] / meas[k], 3) for k in FIGURES}


def _cell(dep: str, wl: str, rounds: list[tuple[dict, dict]]) -> dict:
    """One deployment and workload over its rounds: per figure the median round's ratio, and the
    predicted and measured values of that round."""
    ratios, predicted_ms, measured_ms = {}, {}, {}
    for k in FIGURES:
        ranked = sorted(rounds, key=lambda pm: pm[0][k] / pm[1][k])
        pred, meas = ranked[(len(ranked) - 1) // 2]
        ratios[k] = round(pred[k] / meas[k], 3)
        predicted_ms[k], measured_ms[k] = round(pred[k] * 1000, 1), round(meas[k] * 1000, 1)
    return {
        "deployment": dep,
        "workload": wl,
        "ratios": ratios,
        "within_20pct": {k: 0.8 <= v <= 1.2 for k, v in ratios.items()},
        "rounds": [_ratios(p, m) for p, m in rounds],
        "predicted_ms": predicted_ms,
        "measured_ms": measured_ms,
        "prompt_tokens_mean": {
            "predicted": round(statistics.mean(p["prompt_tokens_mean"] for p, _ in rounds), 1),
            "measured": round(statistics.mean(m["prompt_tokens_mean"] for _, m in rounds), 1),
        },
        "failed": sum(m["failed"] for _, m in rounds),
        "loadavg": [m["loadavg"] for _, m in rounds],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--profile", required=True, help="from pdserve profile (same model; its threads are each worker's)"
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--num-requests", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds per cell, each its own requests; the median round's ratio",
    )
    args = ap.parse_args()
    costs = StepCosts.load(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    cells = []
    workloads = args.workloads.split(",")
    for dep in args.deployments.split(","):
        with start(dep, args.model, costs.threads, tmp) as srv:
            srv.wait_ready(timeout=600)
            rounds: dict[str, list[tuple[dict, dict]]] = {wl: [] for wl in workloads}
            for r in range(args.rounds):
                for wl in workloads:
                    seed = args.seed + r
                    pred = predicted(costs, dep, wl, args.num_requests, seed)
                    meas = measured(srv.url, wl, args.num_requests, seed)
                    rounds[wl].append((pred, meas))
                    print(f"{dep:>10} {wl:>5} round {r}: {_ratios(pred, meas)}", flush=True)
            for wl in workloads:
                cell = _cell(dep, wl, rounds[wl])
                cells.append(cell)
                ratios = cell["ratios"]
                print(
                    f"{dep:>10} {wl:>5}: predicted/measured TTFT p50 {ratios['ttft_p50']:.2f} "
                    f"p90 {ratios['ttft_p90']:.2f} TPOT p50 {ratios['tpot_p50']:.2f} "
                    f"(median of {args.rounds} rounds; measured {cell['measured_ms']}, "
                    f"predicted {cell['predicted_ms']})",
                    flush=True,
                )
    within = sum(v for c in cells for v in c["within_20pct"].values())
    print(
        json.dumps(
            {
                "benchmark": "plan_accuracy",
                "model": args.model,
                "profile_cpu": costs.cpu,
                "cpu": describe(),
                "num_requests": args.num_requests,
                "rounds": args.rounds,
                "cells": cells,
                "within_20pct": f"{within} of {3 * len(cells)}",
            }
        )
    )


if __name__ == "__main__":
    main()
