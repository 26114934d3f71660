"""Expert parallelism across two hosts: the other host's resident set against its share of the
weights, and the decode step's time on a capped link against what the EP plane's bytes predict.

Writes load_memory.py's MoE checkpoint (Qwen3-MoE shape: hidden 1024, 6 layers, 16 experts of
intermediate 512, top 4; bfloat16 on disk, float32 in memory). Two hosts, network namespaces (root
and iproute2; elsewhere loopback addresses, and no link cap): host a runs a mixed worker whose EP=2
rank 0 serves the rendezvous (model.ep_local_ranks 1), host b `pdserve ep-rank --rank 1`. One
thread per rank. Then:

1. Load: --streams greedy completions at once (ignore_eos, --tokens each), twice (warm-up, then
   measured). The step time is the median gap between a stream's chunks; the EP plane's bytes per
   step come from the worker's `pdserve_ep_bytes_total` and `pdserve_ep_steps_total`.
2. Resident set of host b's rank: its anonymous memory (RssAnon: what it allocated, not the
   checkpoint's file pages nor its KV pool's shared pages) less a bare process's (torch and pdserve imported), ÷ the weights it must
   hold: the non-expert weights but the output head (rank 0 runs it over every rank's final rows)
   + its 8 of 16 slots per layer + the standby buffers once the balancer has moved experts (it runs every 8 steps here). Goal <= 1.15.
   Host a's worker (rank 0) likewise: its anonymous and shared memory (the weights rank 0 shares
   with ranks it spawns live in shared memory), not the KV pool's file nor file pages, less a bare
   worker process's, ÷ the non-expert weights with the output head + its 8 slots + standby. No rank
   holds every expert: a move fetches each expert from a rank holding it (model/ep_fetch.py).
3. Link caps (--rates, Mbit/s; a tbf token bucket on each host's interface, both directions): the
   same load per cap; predicted step = uncapped step + bytes per step ÷ rate, where the bytes are
   the larger of each exchange's two directions summed (dispatch and combine both ways, the KV rows
   and final rows for the logits rank b sends, the blocks rank a sends). Prints measured ÷ predicted per cap (goal
   within 0.7-1.3) as a table and one JSON line. About five minutes on 2 cores.

--overlap runs the worker with model.ep_overlap (two micro-batches a step, one's exchange in flight
while the other computes): run it with and without to compare the step per cap.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the namespace hosts live with the cluster tests
sys.path.insert(0, str(ROOT / "benchmarks"))

from cluster.cluster_hosts import Cluster, LoopbackCluster, unavailable  # noqa: E402
from load_memory import _WRITE  # noqa: E402

from pdserve.bench.procs import pdserve_cmd, thread_env  # noqa: E402
from pdserve.protocol import INTERNAL_TOKEN_HEADER  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

PORT, RENDEZVOUS_PORT = 8000, 29500
TOKEN = "ep-hosts-benchmark-token"
KEY = "sk-ep-hosts"  # server.worker_api_keys: the worker serves /v1 beside its internal token
AUTH = {"Authorization": f"Bearer {KEY}"}
RANK_MODULES = "torch, pdserve.model.expert_parallel, pdserve.engine.engine"
WORKER_MODULES = RANK_MODULES + ", pdserve.server.app, pdserve.cli"


def bare_rss_anon(modules: str) -> int:
    """RssAnon of a fresh process that only imported `modules`: what any such process holds."""
    code = f"import {modules}\nprint(dict(l.split(':', 1) for l in open('/proc/self/status'))['RssAnon'].split()[0])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout) * 1024


def rss_anon(pid: int) -> int:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["RssAnon"].split()[0]) * 1024


def own_memory(pid: int) -> int:
    """Resident bytes of a process's anonymous and shared-memory mappings, but the KV pool's file:
    what it allocated, not libraries' or the checkpoint's file pages."""
    total, own = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            path = " ".join(fields[5:])
            own = (
                not path
                or path.startswith("[heap]")
                or (
                    (path.startswith("/dev/shm/") or path.startswith("/memfd:")) and "pdserve-kv-" not in path
                )
            )
        elif own and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def weight_bytes(cfg: dict, slots: int) -> tuple[int, int]:
    """(non-expert but the output head, one expert slot of every MoE layer) bytes in float32: a rank
    of another host drops an untied head (rank 0 computes every rank's logits)."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 2 * h + 2 * cfg["head_dim"] + cfg["num_experts"] * h
    dense = vocab * h + layers * per_layer + h
    expert = 3 * cfg["moe_intermediate_size"] * h
    return 4 * dense, 4 * expert * layers * slots


def stream(url: str, model: str, prompt: str, tokens: int) -> list[float]:
    """One greedy stream; the arrival time of each chunk."""
    times = []
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    return times


def traffic(url: str) -> dict:
    return httpx.get(url + "/eplb", headers={INTERNAL_TOKEN_HEADER: TOKEN}, timeout=10).json()["traffic"]


def load(url: str, streams: int, tokens: int) -> tuple[float, dict]:
    """Median chunk gap (s) over `streams` concurrent streams, and the EP bytes per step meanwhile."""
    model = httpx.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
    before = traffic(url)
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(lambda p: stream(url, model, p, tokens), prompts))
    after = traffic(url)
    # The middle of each stream, where every stream decodes in the same step.
    gaps = [b - a for t in runs for a, b in zip(t[len(t) // 4 : -len(t) // 4], t[len(t) // 4 + 1 :])]
    steps = max(1, after["steps"] - before["steps"])
    per_step = {k: (after[k] - before[k]) / steps for k in after if k != "steps"}
    return statistics.median(gaps), per_step


def link_bytes(per_step: dict) -> float:
    """Bytes a step puts on the link, each exchange counted by its larger direction."""
    return (
        per_step["dispatch"]
        + per_step["combine"]
        + per_step["kv_mirrored"]
        + per_step["logits"]
        + per_step["kv_shipped"]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rates", default="200,50", help="link caps in Mbit/s, comma-separated")
    ap.add_argument("--overlap", action="store_true", help="model.ep_overlap: two micro-batches a step")
    args = ap.parse_args()
    why_not = unavailable()
    with tempfile.TemporaryDirectory(prefix="pdserve-ep-hosts-") as tmp:
        work = Path(tmp)
        ckpt = work / "model"
        ckpt.mkdir()
        subprocess.run(
            [sys.executable, "-c", _WRITE, str(ckpt), "1024", "6", "moe", "16", "512"],
            check=True,
            capture_output=True,
        )
        cfg = json.loads((ckpt / "config.json").read_text())
        net = (LoopbackCluster if why_not else Cluster)(["a", "b"], work, shm_mb=3072)
        try:
            return run(net, ckpt, cfg, work, args, why_not)
        finally:
            net.close()


def run(net, ckpt: Path, cfg: dict, work: Path, args, why_not: str | None) -> int:
    a, b = net.hosts["a"], net.hosts["b"]
    config = {
        "model": {
            "name": str(ckpt),
            "expert_parallel": 2,
            "ep_local_ranks": 1,
            "ep_rendezvous": f"{a.ip}:{RENDEZVOUS_PORT}",
            "eplb_interval": 8,
            "eplb_threshold": 1.0,
            "ep_overlap": args.overlap,
        },
        "cache": {"device_blocks": 256, "prefix_cache": False},
        "server": {"internal_token": TOKEN, "worker_api_keys": [KEY]},
    }
    path = work / "ep.yaml"
    path.write_text(yaml.safe_dump(config))
    log_b = open(work / "b.log", "wb")
    rank1 = subprocess.Popen(
        net.wrap(b, pdserve_cmd() + ["ep-rank", "--rank", "1", "--config", str(path)]),
        stdout=log_b,
        stderr=subprocess.STDOUT,
        env=thread_env(1),
    )
    try:
        cmd = pdserve_cmd() + ["serve", "--mode", "mixed", "--config", str(path), "--host", a.ip]
        worker = net.start(a, "a", cmd + ["--port", str(PORT), "--threads", "1"], PORT, env=thread_env(1))
        worker.wait_ready(timeout=900)
        url = worker.url
        load(url, args.streams, args.tokens)  # warm-up: kernels, first moves
        step, per_step = load(url, args.streams, args.tokens)
        bare = bare_rss_anon(RANK_MODULES)
        dense, slots = weight_bytes(cfg, 8)
        moved = (
            httpx.get(url + "/eplb", headers={INTERNAL_TOKEN_HEADER: TOKEN}, timeout=10).json()["rebalances"]
            > 0
        )
        held = dense + slots * (2 if moved else 1)
        rss_b = rss_anon(rank1.pid)
        bare_a = bare_rss_anon(WORKER_MODULES)
        head = 0 if cfg.get("tie_word_embeddings") else 4 * cfg["vocab_size"] * cfg["hidden_size"]
        held_a = held + head
        mem_a = own_memory(worker.proc.pid)
        rows = [{"rate_mbit": None, "step_ms": step * 1e3, "predicted_ms": step * 1e3}]
        if why_not is None:
            for rate in [float(r) for r in args.rates.split(",") if r]:
                for h in (a, b):
                    net.shape(h, int(rate * 1e6))
                try:
                    capped, _ = load(url, args.streams, args.tokens)
                finally:
                    for h in (a, b):
                        net.shape(h, None)
                predicted = step + link_bytes(per_step) * 8 / (rate * 1e6)
                rows.append({"rate_mbit": rate, "step_ms": capped * 1e3, "predicted_ms": predicted * 1e3})
        print("| link cap | step (median gap) | predicted | measured ÷ predicted |")
        print("|---|---|---|---|")
        for r in rows:
            cap = "none" if r["rate_mbit"] is None else f"{r['rate_mbit']:g} Mbit/s"
            ratio = r["step_ms"] / r["predicted_ms"]
            print(f"| {cap} | {r['step_ms']:.1f} ms | {r['predicted_ms']:.1f} ms | {ratio:.2f} |")
        print(
            json.dumps(
                {
                    "benchmark": "ep_hosts",
                    "cpu": describe(),
                    "hosts": "loopback" if why_not else "network namespaces",
                    "link_caps": why_not or "tbf on both hosts",
                    "streams": args.streams,
                    "overlap": args.overlap,
                    "ep_bytes_per_step": {k: round(v) for k, v in per_step.items()},
                    "link_bytes_per_step": round(link_bytes(per_step)),
                    "rank1_rss_anon_mb": round(rss_b / 1e6, 1),
                    "bare_process_rss_anon_mb": round(bare / 1e6, 1),
                    "rank1_weights_mb": round(held / 1e6, 1),
                    "standby_counted": moved,
                    "rank1_rss_over_weights": round((rss_b - bare) / held, 3),
                    "rank0_memory_mb": round(mem_a / 1e6, 1),
                    "bare_worker_rss_anon_mb": round(bare_a / 1e6, 1),
                    "rank0_weights_mb": round(held_a / 1e6, 1),
                    "rank0_memory_over_weights": round((mem_a - bare_a) / held_a, 3),
                    "goal_rss": "<= 1.15",
                    "steps": [
                        {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
                    ],
                    "goal_link": "measured / predicted within 0.7-1.3",
                }
            ),
            flush=True,
        )
        return 0
    finally:
        rank1.kill()
        rank1.wait(10)
        log_b.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
