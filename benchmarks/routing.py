"""Routing benchmark: prefix hit rate and load balance of each policy against an oracle, and the
router's decision time over a 1000-worker index.

Part 1 replays one seeded multi-tenant trace (Zipf-popular system prompts per tenant, a fresh user
suffix per request, 5% long documents, Poisson arrivals) through a simulated fleet of mixed
workers (pdserve/planner/simulate.py): each holds a real PrefixCache over a real BlockPool with
LRU eviction and feeds a real KVIndex through KV events, one step late. Per policy:
  hit_rate        hit tokens / prompt tokens, from each worker's true cache when the prefill starts
  vs_oracle       hit_rate / the oracle's; the oracle reads every cache directly and picks, among
                  non-overloaded workers, the longest true prefix match (ties: fewer outstanding
                  tokens). It ignores balance, so it bounds hit rate, not quality.
  load_max_mean   max/mean over workers of busy time = prefilled tokens / prefill speed + generated
                  tokens / decode speed (work actually done; cached tokens cost nothing)
  prompt_max_mean max/mean of prompt tokens assigned (cached or not), for reference
  ttft_*_ms       simulated time to first token (20 ms steps), admission wait included
Part 2 times one decision = KVIndex.match(prompt hashes) + cost(...) over 1000 workers. The index
holds 2000 system prompts, each on as many workers as its Zipf share of traffic fills
(max(1, round(share * 1000)), the spread `cost` itself produces when a prefix's queue outweighs
its hit), 10% of replicas offloaded to host, plus unique per-worker suffix chains.

Python's collector is on while timing, as in a router; --gc-freeze freezes the built index first.
Prints ONE JSON line. Usage: python benchmarks/routing.py [--quick] [--seed N] [--requests N] [--gc-freeze]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.cache.kv_index import KVIndex
from pdserve.cache.prefix_cache import prompt_hashes
from pdserve.planner.simulate import FleetConfig, TraceConfig, multi_tenant_trace, oracle, policy, simulate
from pdserve.protocol import KVEvent
from pdserve.router.policies import RouteRequest, WorkerState, cost

STEP_MS = 20.0
POLICIES = ["cost", "cache_aware", "round_robin", "least_load", "power_of_two"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def fleet_part(args) -> dict:
    trace = multi_tenant_trace(TraceConfig(num_requests=args.requests, seed=args.seed))
    fc = FleetConfig(num_workers=args.workers)
    out: dict[str, dict] = {}
    ref = None
    for name in ["oracle"] + POLICIES:
        make = (lambda ws: oracle(ws)) if name == "oracle" else (lambda ws, n=name: policy(n, seed=args.seed))
        r = simulate(trace, make, fc)
        ref = ref or r.hit_rate
        out[name] = {
            "hit_rate": round(r.hit_rate, 4),
            "vs_oracle": round(r.hit_rate / ref, 3),
            "load_max_mean": round(r.load_max_mean, 3),
            "prompt_max_mean": round(r.prompt_max_mean, 3),
            "ttft_mean_ms": round(r.ttft_mean * STEP_MS, 1),
            "ttft_p99_ms": round(r.ttft_p99 * STEP_MS, 1),
        }
    return out


def synthetic_index(rng: random.Random, workers: int, prompts: int, bs: int):
    weights = [1.0 / (k + 1) ** 1.1 for k in range(prompts)]
    total = sum(weights)
    chains = [
        prompt_hashes([rng.randrange(50_000) for _ in range(rng.randint(256, 2048))], bs)
        for _ in range(prompts)
    ]
    index, seq = KVIndex(), {}

    def store(wid: str, hashes: list[bytes], tier: str) -> None:
        seq[wid] = seq.get(wid, 0) + 1
        index.apply(
            KVEvent(
                type="stored",
                block_hashes=[h.hex() for h in hashes],
                tier=tier,
                worker_id=wid,
                seq=seq[wid],
                ts=0.0,
            )
        )

    holders = []
    for k, chain in enumerate(chains):
        copies = min(workers, max(1, round(weights[k] / total * workers)))
        holders.append(copies)
        for w in rng.sample(range(workers), copies):
            store(f"w{w}", chain, "host" if rng.random() < 0.1 else "device")
    for w in range(workers):  # each worker's own recent conversations
        for _ in range(10):
            store(f"w{w}", [rng.randbytes(16) for _ in range(rng.randint(4, 40))], "device")
    return index, chains, weights, max(holders)


def decision_part(args) -> dict:
    rng = random.Random(args.seed)
    bs, n_workers = 16, 1000
    t0 = time.perf_counter()
    index, chains, weights, max_holders = synthetic_index(rng, n_workers, 2000, bs)
    build_s = time.perf_counter() - t0
    states = [
        WorkerState(
            f"w{i}",
            "mixed",
            healthy=rng.random() > 0.02,
            in_flight=rng.randint(0, 63),
            queued_prefill_tokens=rng.randint(0, 20_000),
            decode_tokens=rng.randint(0, 20_000),
            kv_usage=rng.random() * 0.97,
            kv_free_blocks=rng.randint(0, 8192),
            kv_total_blocks=8192,
        )
        for i in range(n_workers)
    ]
    match_t, policy_t, total_t, hits = [], [], [], []
    gc.collect()
    if args.gc_freeze:  # what a gateway can do after loading its index: full GCs skip it
        gc.freeze()
    for _ in range(args.decisions):
        chain = rng.choices(chains, weights)[0]
        tail = rng.randint(1, 32) + (rng.randint(256, 512) if rng.random() < 0.05 else 0)
        hashes = chain + [rng.randbytes(16) for _ in range(tail)]  # the gateway hashes tokens to bytes
        n = (len(hashes) + 1) * bs - 3
        t1 = time.perf_counter()
        m = index.match(hashes)
        t2 = time.perf_counter()
        d = cost(RouteRequest(n, 256, bs, m), states)
        t3 = time.perf_counter()
        assert d.worker_id is not None
        match_t.append(t2 - t1)
        policy_t.append(t3 - t2)
        total_t.append(t3 - t1)
        hits.append(len(m))

    def ms(xs, q):
        return round(pct(xs, q) * 1e3, 3)

    return {
        "workers": n_workers,
        "gc_freeze": args.gc_freeze,
        "indexed_blocks": len(index),
        "max_holders": max_holders,
        "build_s": round(build_s, 1),
        "decisions": len(total_t),
        "mean_holders": round(sum(hits) / len(hits), 1),
        "decision_p50_ms": ms(total_t, 0.5),
        "decision_p99_ms": ms(total_t, 0.99),
        "match_p50_ms": ms(match_t, 0.5),
        "match_p99_ms": ms(match_t, 0.99),
        "policy_p50_ms": ms(policy_t, 0.5),
        "policy_p99_ms": ms(policy_t, 0.99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1000 requests, 300 decisions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() the built index before timing")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.decisions = 1000, 300
    t0 = time.perf_counter()
    fleet = fleet_part(args)
    dec = decision_part(args)
    goals = {f"{p}_hit_ge_0.9_oracle": fleet[p]["vs_oracle"] >= 0.9 for p in ("cost", "cache_aware")}
    goals.update({f"{p}_load_le_1.2": fleet[p]["load_max_mean"] <= 1.2 for p in ("cost", "cache_aware")})
    goals["decision_p99_le_1ms"] = dec["decision_p99_ms"] <= 1.0
    print(
        json.dumps(
            {
                "benchmark": "routing",
                "workers": args.workers,
                "requests": args.requests,
                "seed": args.seed,
                "policies": fleet,
                "decision": dec,
                "goals": goals,
                "seconds": round(time.perf_counter() - t0, 1),
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
