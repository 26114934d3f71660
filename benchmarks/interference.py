"""Prefill interference on decode: PD against mixed, in one run. Prints one JSON line.

Workload: 8 streaming decode requests run while a 2048-token prompt arrives every second. The
figure is the streams' p99 inter-token latency (ITL) with the prompts arriving, divided by the
same streams' p99 ITL with no prompts arriving, for:
  - PD: `pdserve serve` (router, 1 prefill + 1 decode worker, one torch thread each; a decode step
    also takes the prefill worker's thread while it is idle: deployment.share_idle_cores);
  - PD with own threads: the same with `--no-share-idle-cores`;
  - mixed: `pdserve serve --mode mixed --threads 2` (one worker, chunked prefill).
Goal: PD <= 1.3. In mixed mode each prompt chunk shares a step with the decodes; in PD the
decode worker only receives KV (written into its memory by the prefill worker) and never
computes a prompt. Lent cores make PD's quiet steps faster, which raises its ratio without a slower
step, so the two PD runs' ITLs are printed side by side as well: with prompts arriving the shared
run's p99 ÷ the own-threads run's (the cost of lending) and quiet (the gain).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.metrics import nearest_rank_p99 as p99  # noqa: E402
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd, thread_env  # noqa: E402

MODEL = "smollm2-135m"


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the stream's chunks (one token each)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    return times


async def phase(url: str, prompt_len: int, period: float, streams: int, max_tokens: int, seed: int) -> dict:
    """`streams` decode streams; with period > 0, a `prompt_len` prompt arrives every `period` s meanwhile."""
    async with httpx.AsyncClient(timeout=600) as client:
        prompts = [[(seed * 7919 + 31 * i + 17 * j) % 40000 + 100 for j in range(16)] for i in range(streams)]
        tasks = [asyncio.create_task(stream(client, url, p, max_tokens)) for p in prompts]
        arrivals = []
        k = 0
        while period > 0 and not all(t.done() for t in tasks):
            k += 1
            long_prompt = [(seed * 104729 + 13 * k + 7 * j) % 40000 + 100 for j in range(prompt_len)]
            arrivals.append(
                asyncio.create_task(
                    client.post(
                        url + "/v1/completions",
                        json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1, "temperature": 0},
                    )
                )
            )
            await asyncio.sleep(period)
        results = await asyncio.gather(*tasks)
        for a in arrivals:
            a.cancel()
        await asyncio.gather(*arrivals, return_exceptions=True)
    # The first gap of each stream is its time to first token, not an ITL.
    itls = [b - a for ts in results for a, b in zip(ts[1:], ts[2:])]
    return {
        "p99_itl_ms": p99(itls) * 1e3,
        "median_itl_ms": statistics.median(itls) * 1e3,
        "prompts_sent": len(arrivals),
    }


def measure(name: str, cmd: list[str], threads: int, args, out_dir: Path) -> dict:
    port = free_port()
    with ServerProcess(
        cmd + ["--port", str(port)], port, out_dir / f"{name}.log", env=thread_env(threads)
    ) as srv:
        srv.wait_ready(timeout=600)
        url = srv.url
        asyncio.run(phase(url, 64, 0, 2, 8, 0))  # warm up
        quiet = asyncio.run(phase(url, args.prompt_len, 0, args.streams, args.max_tokens, 1))
        busy = asyncio.run(phase(url, args.prompt_len, args.period, args.streams, args.max_tokens, 2))
    ratio = busy["p99_itl_ms"] / quiet["p99_itl_ms"]
    print(
        f"{name}: p99 ITL {quiet['p99_itl_ms']:.1f} ms quiet, {busy['p99_itl_ms']:.1f} ms with prompts "
        f"({busy['prompts_sent']} sent): {ratio:.2f}x",
        file=sys.stderr,
    )
    return {
        "ratio": round(ratio, 2),
        "quiet_p99_itl_ms": round(quiet["p99_itl_ms"], 1),
        "busy_p99_itl_ms": round(busy["p99_itl_ms"], 1),
        "quiet_median_itl_ms": round(quiet["median_itl_ms"], 1),
        "busy_median_itl_ms": round(busy["median_itl_ms"], 1),
        "prompts_sent": busy["prompts_sent"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per decode stream")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--period", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--systems", default="pd,pd-own,mixed", help="comma list from pd,pd-own,mixed")
    p.add_argument("--out-dir", default="/tmp/pdserve-interference")
    a = p.parse_args(argv)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = pdserve_cmd() + ["serve", "--model", MODEL, "--max-model-len", "4096", "--no-prefix-cache"]
    systems = {
        "pd": (base + ["--mode", "pd"], 1),
        "pd-own": (base + ["--mode", "pd", "--no-share-idle-cores"], 1),
        "mixed": (base + ["--mode", "mixed", "--threads", "2"], 2),
    }
    names = [n.strip() for n in a.systems.split(",") if n.strip()]
    unknown = sorted(set(names) - set(systems))
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose from {sorted(systems)}")
    runs = {n: measure(n, *systems[n], a, out_dir) for n in names}
    result = {
        "bench": "interference",
        "streams": a.streams,
        "prompt_len": a.prompt_len,
        "period_s": a.period,
        **{f"{n.replace('-', '_')}_ratio": r["ratio"] for n, r in runs.items()},
        **{n.replace("-", "_"): r for n, r in runs.items()},
        "goal_pd_ratio": 1.3,
    }
    if "pd" in runs and "pd-own" in runs:
        pd, own = runs["pd"], runs["pd-own"]
        result["shared_over_own"] = {
            f"{phase}_{stat}_itl": round(pd[f"{phase}_{stat}_itl_ms"] / own[f"{phase}_{stat}_itl_ms"], 2)
            for stat in ("p99", "median")
            for phase in ("busy", "quiet")
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
