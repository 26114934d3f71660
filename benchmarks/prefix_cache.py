"""Prefix cache through the server: a multi-turn chat trace with and without the cache, in one run.

Trace (fixed seed): 16 conversations x 4 turns sharing a ~400-token system prompt; each user turn
10-40 words; every reply is 32 greedy tokens and goes back into the conversation. Like the
multi-turn benchmarks of vLLM and Dynamo, the trace is timed: conversations start at exponential
gaps (mean `--start-gap-s`) and the user thinks for an exponential time (mean `--think-s`) between a
reply and the next turn, all drawn from the seed, so every run replays the same schedule. The
same trace is sent, one run after the other, to a mixed server with the prefix cache, to one
without (`--no-prefix-cache`), and to one whose device pool is too small to hold the trace
(`--tier-device-blocks`, about half of it by default) with a host-RAM tier that spills to a disk
tier, so that hits come from host or disk. A burst variant (every conversation starts at once, no
think time, so 10-16 turns arrive together and queue behind each other) runs with and without the
cache too, and is reported beside it.

Prints one JSON line:
  - prefill tokens computed / unique prompt tokens (the distinct prefixes of all 64 prompts),
    with the cache (goal <= 1.05), without, and tiered;
  - TTFT p50 cached / uncached on the timed trace (goal <= 0.25), tiered / uncached (reported),
    with the tier hits per tier, and cached / uncached on the burst (reported);
  - whether every reply was identical in all runs (greedy decoding must not see the cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.bench.workloads import words

MODEL = "smollm2-135m"


@dataclass
class Conversation:
    start_s: float  # when its first turn is sent, from the start of the run
    turns: list[str]  # the user's messages
    think_s: list[float]  # the pause before each turn after its previous reply (0 before the first)


def make_trace(
    seed: int, conversations: int, turns: int, start_gap_s: float = 0.0, think_s: float = 0.0
) -> tuple[str, list[Conversation]]:
    """The system prompt and the conversations. The texts depend on the seed only, so the timed
    trace and the burst carry the same prompts; a mean of 0 gives no gap and no think time."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + words(rng, 360)
    texts = [[words(rng, rng.randint(10, 40)) for _ in range(turns)] for _ in range(conversations)]
    timing = random.Random(seed + 1)

    def draw(mean: float) -> float:
        return timing.expovariate(1 / mean) if mean > 0 else 0.0

    convs, start = [], 0.0
    for t in texts:
        convs.append(Conversation(start, t, [0.0] + [draw(think_s) for _ in t[1:]]))
        start += draw(start_gap_s)
    return system, convs


async def _turn(
    client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int
) -> tuple[float, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, text = None, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(delta)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text)


async def run_trace(url: str, system: str, convs: list[Conversation], max_tokens: int):
    prompts: list[list[dict]] = []
    ttfts: list[float] = []
    replies: list[str] = []

    async with httpx.AsyncClient(timeout=600) as client:

        async def conversation(conv: Conversation) -> None:
            await asyncio.sleep(conv.start_s)
            messages = [{"role": "system", "content": system}]
            for text, pause in zip(conv.turns, conv.think_s):
                await asyncio.sleep(pause)
                messages.append({"role": "user", "content": text})
                ttft, reply = await _turn(client, url, messages, max_tokens)
                prompts.append(list(messages))  # recorded together: conversations interleave
                ttfts.append(ttft)
                replies.append(reply)
                messages.append({"role": "assistant", "content": reply})

        await asyncio.gather(*(conversation(c) for c in convs))
    return prompts, ttfts, replies


def unique_prompt_tokens(token_lists: list[list[int]]) -> int:
    """Nodes of the token trie of all prompts: what a perfect prefix cache would compute."""
    root: dict = {}
    count = 0
    for ids in token_lists:
        node = root
        for t in ids:
            if t not in node:
                node[t] = {}
                count += 1
            node = node[t]
    return count


def serve_and_run(args, label: str, extra: list[str], system: str, convs, out_dir: Path):
    port = free_port()
    # One mixed process: its /health carries the engine's counters.
    cmd = (
        pdserve_cmd()
        + ["serve", "--mode", "mixed", "--model", MODEL, "--port", str(port), "--threads", str(args.threads)]
        + extra
    )
    with ServerProcess(cmd, port, out_dir / f"server-{label}.log") as srv:
        srv.wait_ready(timeout=300)
        prompts, ttfts, replies = asyncio.run(run_trace(srv.url, system, convs, args.max_tokens))
        stats = httpx.get(srv.url + "/health").json()
    return prompts, ttfts, replies, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-gap-s", type=float, default=3.0, help="mean gap between conversation starts")
    ap.add_argument(
        "--think-s", type=float, default=12.0, help="mean pause between a reply and the next turn"
    )
    ap.add_argument("--no-burst", action="store_true", help="skip the burst variant")
    ap.add_argument(
        "--tier-device-blocks",
        type=int,
        default=128,
        help="device pool of the tiered run, in 16-token blocks (the full trace needs ~280)",
    )
    ap.add_argument(
        "--tier-host-gb", type=float, default=0.05, help="host tier of the tiered run (~70 blocks)"
    )
    ap.add_argument("--tier-disk-gb", type=float, default=1.0, help="disk tier of the tiered run")
    ap.add_argument("--out-dir", default="bench-out/prefix_cache")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    system, convs = make_trace(args.seed, args.conversations, args.turns, args.start_gap_s, args.think_s)

    t0 = time.perf_counter()
    cached = serve_and_run(args, "cached", [], system, convs, out_dir)
    trace_s = time.perf_counter() - t0
    uncached = serve_and_run(args, "uncached", ["--no-prefix-cache"], system, convs, out_dir)
    disk_dir = out_dir / "kv-disk"
    shutil.rmtree(disk_dir, ignore_errors=True)  # hits must come from this run only
    tiered = serve_and_run(
        args,
        "tiered",
        [
            "--device-blocks",
            str(args.tier_device_blocks),
            "--host-cache-gb",
            str(args.tier_host_gb),
            "--disk-cache-dir",
            str(disk_dir),
            "--disk-cache-gb",
            str(args.tier_disk_gb),
        ],
        system,
        convs,
        out_dir,
    )
    shutil.rmtree(disk_dir, ignore_errors=True)
    runs = [cached, uncached, tiered]
    burst = {}
    if not args.no_burst:
        _, burst_convs = make_trace(args.seed, args.conversations, args.turns)
        for label, extra in (("cached", []), ("uncached", ["--no-prefix-cache"])):
            burst[label] = serve_and_run(args, f"burst-{label}", extra, system, burst_convs, out_dir)
        runs += list(burst.values())

    from pdserve.model.loader import default_gguf_path, load_gguf_tokenizer

    tok = load_gguf_tokenizer(str(default_gguf_path()))
    token_lists = [tok.encode_chat(p) for p in cached[0]]
    unique = unique_prompt_tokens(token_lists)

    def by_prompt(run) -> dict[str, str]:
        return {json.dumps(p): r for p, r in zip(run[0], run[2])}

    first_turn_same = sum(
        by_prompt(cached).get(json.dumps(p)) == r for p, r in zip(uncached[0], uncached[2]) if len(p) == 2
    )

    def p50_ms(run) -> float:
        return round(statistics.median(run[1]) * 1e3, 1)

    ttft_ratio = statistics.median(cached[1]) / statistics.median(uncached[1])
    ts = tiered[3]
    burst_figures = (
        {}
        if not burst
        else {
            "burst_ttft_p50_ms_cached": p50_ms(burst["cached"]),
            "burst_ttft_p50_ms_uncached": p50_ms(burst["uncached"]),
            "burst_ttft_p50_ratio": round(
                statistics.median(burst["cached"][1]) / statistics.median(burst["uncached"][1]), 3
            ),
            "burst_computed_over_unique_cached": round(
                burst["cached"][3]["prefill_tokens_computed"] / unique, 3
            ),
        }
    )
    print(
        json.dumps(
            {
                "benchmark": "prefix_cache",
                "requests": len(cached[1]),
                "threads": args.threads,
                "start_gap_s": args.start_gap_s,
                "think_s": args.think_s,
                "trace_s": round(trace_s, 1),
                "unique_prompt_tokens": unique,
                "prompt_tokens_sent": sum(map(len, token_lists)),
                "prefill_tokens_cached": cached[3]["prefill_tokens_computed"],
                "prefill_tokens_uncached": uncached[3]["prefill_tokens_computed"],
                "computed_over_unique_cached": round(cached[3]["prefill_tokens_computed"] / unique, 3),
                "computed_over_unique_uncached": round(uncached[3]["prefill_tokens_computed"] / unique, 3),
                "prefix_hit_rate": round(
                    cached[3]["prefix_cache_hit_tokens"] / max(1, cached[3]["prefix_cache_queried_tokens"]), 3
                ),
                "ttft_p50_ms_cached": p50_ms(cached),
                "ttft_p50_ms_uncached": p50_ms(uncached),
                "ttft_p50_ratio": round(ttft_ratio, 3),
                "tier_device_blocks": args.tier_device_blocks,
                "ttft_p50_ms_tiered": p50_ms(tiered),
                "ttft_p50_ratio_tiered": round(
                    statistics.median(tiered[1]) / statistics.median(uncached[1]), 3
                ),
                "computed_over_unique_tiered": round(ts["prefill_tokens_computed"] / unique, 3),
                "tiered_device_hit_tokens": ts["prefix_cache_hit_tokens"],
                "tiered_fetched_tokens": ts.get("tier_fetched_tokens_total", 0),
                "tiered_block_hits": {t: ts.get(f"tier_{t}_hits_total", 0) for t in ("host", "disk")},
                "tiered_fetch_fallbacks": ts.get("tier_fetch_fallbacks_total", 0),
                **burst_figures,
                "replies_identical": all(by_prompt(r) == by_prompt(cached) for r in runs),
                "first_turn_replies_identical": f"{first_turn_same}/{len(convs)}",
                "goals": {
                    "computed_over_unique_cached": "<= 1.05",
                    "ttft_p50_ratio": "<= 0.25",
                    "ttft_p50_ratio_tiered": "reported",
                    "burst_ttft_p50_ratio": "reported",
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
