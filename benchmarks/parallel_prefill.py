"""Time to first token of a long prompt: two prefill workers in a layer-wise pipeline against one. One JSON line.

Processes: two prefill workers (`pdserve worker --role prefill`, one torch thread each) and a decode
worker (one thread) that asks them for the prompt's KV; a client posts 4,000-token prompts (fresh
random token ids each, so no prefix cache helps) to the decode worker with max_tokens 1 and times
the reply. Baseline, same run: a decode worker that knows only the first prefill worker (one
worker, one thread, computes the whole prompt). Pipeline: a decode worker that knows both, with
disagg.parallel_prefill_min_tokens below the prompt (disagg/parallel.py cuts it by estimated
compute; the second chunk's worker computes layer l as soon as the first chunk's layer l is in).
Both compute a prompt chunk in one step (scheduler.max_num_batched_tokens above the prompt).
Figure: median TTFT pipeline / median TTFT one worker; ideal about 0.5, goal <= 0.65.
`--small` runs 1,000-token prompts, one trial each (a quick check, not the figure).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd, thread_env  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

MODEL = "smollm2-135m"


def worker(role: str, name: str, config: Path, out_dir: Path, extra: list[str]) -> tuple[ServerProcess, str]:
    """A started worker process and its KV endpoint."""
    port, kv_port = free_port(), free_port()
    cmd = pdserve_cmd() + [
        "worker",
        "--role",
        role,
        "--config",
        str(config),
        "--port",
        str(port),
        "--kv-port",
        str(kv_port),
        *extra,
    ]
    return ServerProcess(cmd, port, out_dir / f"{name}.log", env=thread_env(1)), f"tcp://127.0.0.1:{kv_port}"


def ttft(url: str, tokens: int, rng: random.Random) -> float:
    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
    t0 = time.monotonic()
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=600,
    )
    r.raise_for_status()
    return time.monotonic() - t0


def measure(
    name: str, endpoints: list[str], config: Path, out_dir: Path, tokens: int, trials: int, rng: random.Random
) -> list[float]:
    decode, _ = worker("decode", name, config, out_dir, ["--prefill-endpoints", ",".join(endpoints)])
    with decode:
        decode.wait_ready(timeout=600)
        ttft(decode.url, 256, rng)  # warm up both ends
        times = [ttft(decode.url, tokens, rng) for _ in range(trials)]
        stats = httpx.get(decode.url + "/metrics", timeout=10).text
    pipelined = next(
        (
            ln.split()[-1]
            for ln in stats.splitlines()
            if not ln.startswith("#") and "kv_parallel_prefills_total" in ln
        ),
        "?",
    )
    print(
        f"{name}: TTFT {', '.join(f'{t:.2f}' for t in times)} s (pipelined requests: {pipelined})",
        file=sys.stderr,
    )
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4000, help="prompt length")
    p.add_argument("--trials", type=int, default=3, help="prompts timed per setting")
    p.add_argument("--small", action="store_true", help="1,000-token prompts, one trial (a quick check)")
    p.add_argument(
        "--attention-weight", type=float, default=1.0, help="disagg.parallel_prefill_attention_weight"
    )
    p.add_argument("--out-dir", default="/tmp/pdserve-parallel-prefill")
    a = p.parse_args(argv)
    tokens, trials = (1000, 1) if a.small else (a.tokens, a.trials)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = out_dir / "config.yaml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "model": {"name": MODEL, "max_model_len": max(2048, tokens + 64)},
                "server": {"threads": 1},
                "scheduler": {"max_num_batched_tokens": tokens + 64},
                # A chunk is one step, seconds long on one thread: the transfer deadline must cover it.
                "disagg": {
                    "transfer_timeout_s": 300,
                    "parallel_prefill_min_tokens": tokens // 2,
                    "parallel_prefill_attention_weight": a.attention_weight,
                },
            }
        )
    )
    rng = random.Random(0)
    p1, ep1 = worker("prefill", "prefill-1", config, out_dir, [])
    p2, ep2 = worker("prefill", "prefill-2", config, out_dir, [])
    with p1, p2:
        p1.wait_ready(timeout=600)
        p2.wait_ready(timeout=600)
        one = measure("one-worker", [ep1], config, out_dir, tokens, trials, rng)
        two = measure("pipeline", [ep1, ep2], config, out_dir, tokens, trials, rng)
    ratio = statistics.median(two) / statistics.median(one)
    print(
        json.dumps(
            {
                "bench": "parallel_prefill",
                "cpu": describe(),
                "prompt_tokens": tokens,
                "trials": trials,
                "ttft_one_worker_s": round(statistics.median(one), 2),
                "ttft_pipeline_s": round(statistics.median(two), 2),
                "ratio": round(ratio, 3),
                "goal": 0.65,
                "threads_per_worker": 1,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
