"""vLLM's own decoder on pdserve's KV events: the share of a worker's event batches that
`vllm.distributed.kv_events.KVEventBatch` decodes, the sequence gaps left after replay, and a
subscriber that drops out mid-run and catches up through the replay socket. Prints one JSON line.

    python benchmarks/vllm_kv_events.py                  # 1000 requests, tiny-qwen2, layout vllm
    python benchmarks/vllm_kv_events.py --requests 200 --model smollm2-135m

Needs vLLM's CPU build in its own venv, as benchmarks/compare.py installs it (pdserve/bench/
vllm_cpu.py); without it the run says so and stops (it never installs it: minutes of downloads).
A mixed pdserve worker publishes `cache.kv_events_format` events on loopback; the reader
(benchmarks/vllm_kv_events_reader.py, in vLLM's venv, importing nothing of pdserve) decodes every
batch with vLLM's msgspec decoder, replays on gaps, and drops its subscription for a second after
a third of the batches. Requests share 8 prompt prefixes (stores and prefix hits) and the KV
pool is small (evictions: BlockRemoved). Goals: 100% decoded, 0 gaps, the drop replayed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from pdserve.bench import vllm_cpu  # noqa: E402
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

READER = Path(__file__).with_name("vllm_kv_events_reader.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--layout", default="vllm", choices=["vllm", "vllm-array"])
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    python = vllm_cpu.installed()
    if python is None:
        print(json.dumps({"skipped": f"no vllm-cpu {vllm_cpu.VERSION} venv in {vllm_cpu.cache_dir()}"}))
        return 0
    if args.layout == "vllm-array":
        print("note: vllm-cpu", vllm_cpu.VERSION, "decodes the map layout; vllm-array is for older readers")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        port, events, replay = free_port(), free_port(), free_port()
        events_ep, replay_ep = f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"
        (tmp / "c.yaml").write_text(
            f"model: {{name: {args.model}}}\n"
            f"cache: {{kv_events_format: {args.layout}, kv_events_endpoint: '{events_ep}', "
            f"kv_events_snapshot_endpoint: '{replay_ep}', block_size: 16, device_blocks: 64}}\n"
        )
        cmd = pdserve_cmd() + [
            "serve",
            "--mode",
            "mixed",
            "--config",
            str(tmp / "c.yaml"),
            "--port",
            str(port),
        ]
        with ServerProcess(cmd, port, tmp / "server.log") as srv:
            srv.wait_ready(timeout=600)
            done = tmp / "done"
            # The reader drops out after about a third of the batches (a few per request).
            reader = subprocess.Popen(
                [str(python), str(READER), events_ep, replay_ep, str(done), str(max(1, args.requests // 3))],
                stdout=subprocess.PIPE,
                stderr=open(tmp / "reader.log", "w"),  # noqa: SIM115
                text=True,
            )
            assert reader.stdout is not None
            line = reader.stdout.readline()  # after vLLM's import (about 30 s)
            if line.strip() != "ready":
                print(
                    json.dumps(
                        {"error": "the reader did not start", "log": (tmp / "reader.log").read_text()[-2000:]}
                    )
                )
                return 1
            rng = random.Random(0)
            prefixes = [
                " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(60)) for _ in range(8)
            ]
            prompts = [f"{rng.choice(prefixes)} question {i}" for i in range(args.requests)]
            t0 = time.monotonic()
            failed = 0
            with httpx.Client(timeout=300) as client:

                def send(p: str) -> int:
                    body = {"model": args.model, "prompt": p, "max_tokens": 4, "temperature": 0}
                    return client.post(srv.url + "/v1/completions", json=body).status_code

                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                    failed = sum(code != 200 for code in pool.map(send, prompts))
            seconds = time.monotonic() - t0
            done.touch()
            out, _ = reader.communicate(timeout=120)
            got = json.loads(out.strip().splitlines()[-1])
    decoded_share = got["decoded"] / got["batches"] if got["batches"] else 0.0
    print(
        json.dumps(
            {
                "benchmark": "vllm_kv_events",
                "cpu": describe(),
                "vllm": vllm_cpu.VERSION,
                "layout": args.layout,
                "model": args.model,
                "requests": args.requests,
                "failed_requests": failed,
                "seconds": round(seconds, 1),
                **got,
                "decoded_share": round(decoded_share, 4),
                "goal_met": decoded_share == 1.0 and got["gaps"] == 0 and got["failed"] == 0,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
