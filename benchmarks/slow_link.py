"""Layer-wise KV transfer against sending after the forward, over a throttled link between hosts.

Three hosts made of Linux namespaces (tests/cluster/cluster_hosts.py: own address, hostname and
/dev/shm, so `transfer.backend: auto` moves the KV over tcp): two prefill hosts running the real
model (smollm2-135m, one thread each), one with `transfer.layerwise: true` (the default: each
layer's blocks are written as soon as that layer is computed) and one with `layerwise: false`
(every layer written after the forward), and one decode host. Both prefill hosts' links are capped
at the same rate by a `tbf` token bucket (netem is not needed). Requests go to the decode worker's
OpenAI API naming the prefill peer (the header the router sets), alternating between the two
prefill hosts, one at a time, each with a fresh prompt (no prefix cache hit anywhere).

The rate: by default the one at which a prompt's KV takes as long on the wire as the prefill takes
to compute (calibrated in the same run on the unthrottled link: KV bytes per prompt over the
layer-wise TTFT), where the overlap matters most; `--mbit` sets it instead.

Printed (one JSON line): TTFT p50 of each mode over the throttled link and their ratio
layerwise / after-forward (goal < 1; the ideal with compute c and wire time t is max(c, t) / (c + t)),
the unthrottled TTFTs, the KV bytes per prompt, the rate, the decode side's failed transfers (must
be 0: nothing timed out) and the CPU. Needs root and iproute2; prints why and exits 0 otherwise.

Usage: python benchmarks/slow_link.py [--requests 8] [--prompt-tokens 512] [--mbit N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the namespace hosts live with the cluster tests

from cluster.cluster_hosts import Cluster, ShapingUnavailable, unavailable  # noqa: E402

from pdserve.bench.procs import pdserve_cmd, thread_env  # noqa: E402
from pdserve.protocol import INTERNAL_TOKEN_HEADER  # noqa: E402
from pdserve.server.openai_api import PREFILL_HEADER  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

MODEL = "smollm2-135m"
TOKEN = "slow-link-token"
PORT, KV_PORT = 8000, 5556
MODES = {"prefill-lw": True, "prefill-af": False}  # host -> transfer.layerwise


def start(net: Cluster, tmp: Path) -> dict[str, str]:
    """The three workers; returns each prefill host's KV endpoint."""
    base = {
        "model": {"name": MODEL},
        "server": {"internal_token": TOKEN},
        "cache": {"device_blocks": 256},
        "disagg": {"transfer_timeout_s": 60, "bootstrap_timeout_s": 30},
    }
    procs = {}
    for name, role in [("decode", "decode"), *((h, "prefill") for h in MODES)]:
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({**base, "transfer": {"layerwise": MODES.get(name, True)}}))
        h = net.hosts[name]
        procs[name] = net.start(
            h,
            name,
            pdserve_cmd()
            + [
                "worker",
                "--role",
                role,
                "--config",
                str(cfg),
                "--host",
                h.ip,
                "--port",
                str(PORT),
                "--kv-port",
                str(KV_PORT),
                "--threads",
                "1",
            ],
            PORT,
            env=thread_env(1),
        )
    for srv in procs.values():
        srv.wait_ready(timeout=600)
    return {h: httpx.get(procs[h].url + "/health", timeout=10).json()["kv_endpoint"] for h in MODES}


def ttft(decode_url: str, peer: str, prompt: list[int]) -> float:
    """Seconds from sending the request to the first streamed token."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {PREFILL_HEADER: peer, INTERNAL_TOKEN_HEADER: TOKEN}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", decode_url + "/v1/completions", json=body, headers=headers, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream sent no token")
    return first


def health(net: Cluster, name: str) -> dict:
    return httpx.get(net.hosts[name].url(PORT) + "/health", timeout=10).json()


def run(args) -> dict:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="slow-link-"))
    net = Cluster(["decode", *MODES], tmp, shm_mb=1024)
    try:
        peers = start(net, tmp)
        url = net.hosts["decode"].url(PORT)

        def prompt() -> list[int]:
            return [rng.randrange(10, 40000) for _ in range(args.prompt_tokens)]

        def rounds(n: int) -> dict[str, list[float]]:
            got: dict[str, list[float]] = {h: [] for h in MODES}
            for i in range(n):
                order = list(MODES) if i % 2 == 0 else list(reversed(MODES))  # neither mode always goes first
                for h in order:
                    got[h].append(ttft(url, peers[h], prompt()))
            return got

        rounds(1)  # warm-up: first forwards, connections
        sent0 = health(net, "prefill-lw")["kv_send_bytes_total"]
        fast = rounds(args.calibration)
        per_prompt = (health(net, "prefill-lw")["kv_send_bytes_total"] - sent0) / args.calibration
        compute_s = statistics.median(fast["prefill-lw"])
        mbit = args.mbit or max(1, round(per_prompt * 8 / compute_s / 1e6))
        failed0 = health(net, "decode")["kv_transfers_failed_total"]
        for h in MODES:
            net.shape(net.hosts[h], int(mbit * 1e6))
        slow = rounds(args.requests)
        dec = health(net, "decode")
        lw, af = (statistics.median(slow[h]) for h in MODES)
        wire_s = per_prompt * 8 / (mbit * 1e6)
        return {
            "benchmark": "slow_link",
            "cpu": describe(),
            "model": MODEL,
            "prompt_tokens": args.prompt_tokens,
            "requests_per_mode": args.requests,
            "kv_bytes_per_prompt": int(per_prompt),
            "link_mbit_s": mbit,
            "wire_s_per_prompt": round(wire_s, 3),
            "ttft_p50_unthrottled_s": {h: round(statistics.median(fast[h]), 3) for h in MODES},
            "ttft_p50_throttled_s": {h: round(statistics.median(slow[h]), 3) for h in MODES},
            "ttft_throttled_all_s": {h: [round(x, 3) for x in slow[h]] for h in MODES},
            "ratio_layerwise_vs_after_forward": round(lw / af, 3),
            "ideal_ratio": round(max(compute_s, wire_s) / (compute_s + wire_s), 3),
            "decode_transfers_failed": dec["kv_transfers_failed_total"] - failed0,
            "decode_local_prefill_fallbacks": dec["kv_local_prefill_fallbacks_total"],
        }
    finally:
        net.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="throttled requests per mode")
    ap.add_argument("--calibration", type=int, default=3, help="unthrottled requests per mode")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--mbit", type=float, default=None, help="link rate in Mbit/s (default: calibrated)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        print(f"slow_link: skipped: {reason}")
        return 0
    try:
        out = run(args)
    except ShapingUnavailable as e:
        print(f"slow_link: skipped: this kernel cannot throttle a link: {e}")
        return 0
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
