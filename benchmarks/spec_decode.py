"""Speculative decoding: output tokens per second with drafts ÷ without, in the same run, on an
input-grounded workload and an open-ended one. Prints one JSON line.

Deployment: `pdserve serve` as installed (PD: router, one prefill and one decode worker, the default
model), started three times: `--speculative-method ngram` (or `--method draft`: a draft model, by
default the served model's own int4 weights, for a `--quantization none` deployment), `none` with
`--batch-invariant` (speculative decoding turns that on: a verify step's rows must compute what a plain
step's do, so both servers' int4 products take one arithmetic at every row count, docs/kernels.md, and
their greedy texts must be identical), and `default`: `none` as installed, what a deployment without
drafts runs (its products on the row-count paths; its texts may differ by those paths' rounding).
Workloads (chat, greedy, so the two servers' texts must be identical):
- grounded: rewrite a given paragraph with its spelling fixed, or return a given Python function
  with one name changed (the answer quotes its input: drafts from the prompt are accepted);
- open: stories, lists and explanations with no text to quote.
Each at 1, 8 and 32 closed-loop streams (`--streams`), `--per-stream` requests per stream. The
servers run side by side and are measured in turns, `--rounds` times, the order rotating; the
figures are the median round's ratios: drafts ÷ `none` (`ratio`) and drafts ÷ `default`
(`ratio_vs_default`: what turning drafts on gains a deployment).
Goals: both >= 1.5 at 1 and 8 streams on grounded, >= 0.95 on open (never a loss beyond noise), and
greedy texts identical with and without drafts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.client import ClientConfig, run_load  # noqa: E402
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd  # noqa: E402
from pdserve.bench.workloads import Session, Turn  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

PARAGRAPHS = [
    "The lighthouse keeper climbed the stairs every evening at sunset. He cleaned the great lens, "
    "trimmed the wick and watched the ships pass slowly along the dark coast. In winter the storms "
    "came often, and the waves rose high enough to wash over the rocks below the tower.",
    "Our team meets every Monday to plan the week. Each person shares what they finished, what they "
    "will work on next and anything that blocks them. The notes are written in the shared document "
    "so that everyone can read them later.",
]
CODE = [
    "def total(x):\n    s = 0\n    for v in x:\n        s = s + v\n    return s\n\n"
    "def average(x):\n    if not x:\n        return 0\n    return total(x) / len(x)\n",
    "def find(items, x):\n    for i, item in enumerate(items):\n        if item == x:\n            return i\n"
    "    return -1\n\n\ndef count(items, x):\n    return sum(1 for item in items if item == x)\n",
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "List ten ideas for a weekend trip and explain each in one sentence.",
    "Explain how a refrigerator keeps food cold.",
    "Describe a perfect morning in a small mountain village.",
]


def _typos(text: str) -> str:
    return text.replace("the ", "teh ").replace("ight", "iht").replace("every", "evrey")


def grounded(i: int) -> str:
    if i % 2:
        return (
            f"Return this Python code unchanged except that the name x becomes values:\n\n{CODE[i // 2 % 2]}"
        )
    return f"Rewrite this text with its spelling mistakes fixed and nothing else changed:\n\n{_typos(PARAGRAPHS[i // 2 % 2])}"


def _sessions(kind: str, n: int, max_tokens: int) -> list[Session]:
    text = grounded if kind == "grounded" else (lambda i: OPEN[i % len(OPEN)])
    return [Session(i, [Turn(text(i), max_tokens)]) for i in range(n)]


def _measure(
    url: str, kind: str, streams: int, per_stream: int, max_tokens: int
) -> tuple[float, list[str], int]:
    cfg = ClientConfig(base_url=url, temperature=0.0)
    recs, wall = asyncio.run(
        run_load(cfg, _sessions(kind, streams * per_stream, max_tokens), concurrency=streams)
    )
    failed = sum(1 for r in recs if r.error)
    tokens = sum(r.completion_tokens or 0 for r in recs)
    return tokens / wall, [r.text for r in recs], failed


def _spec_counts(url: str) -> tuple[float, float]:
    """(draft tokens verified, accepted) so far, summed over the deployment's decode workers."""
    workers = httpx.get(url + "/admin/workers", timeout=10).json()["workers"]
    draft = accepted = 0.0
    for w in workers:
        if w["role"] != "decode":
            continue
        for line in httpx.get(w["url"] + "/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("pdserve_spec_draft_tokens_total"):
                draft += float(value)
            elif name.startswith("pdserve_spec_accepted_tokens_total"):
                accepted += float(value)
    return draft, accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--per-stream", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2, help="measurements of each pair, alternating")
    ap.add_argument("--quantization", default=None, help="model.quantization of both servers")
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    ap.add_argument(
        "--speculative-model", default=None, help="--method draft: the draft model (default: the served one)"
    )
    ap.add_argument("--speculative-quantization", default="int4", help="--method draft: its weights")
    ap.add_argument(
        "--spec-arg",
        action="append",
        default=[],
        help="an extra `pdserve serve` argument for the drafting server (repeatable), e.g. "
        "--spec-arg=--num-speculative-tokens=8",
    )
    ap.add_argument("--log-dir", default="/tmp/pdserve-bench-spec")
    args = ap.parse_args()
    levels = [int(s) for s in args.streams.split(",")]
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    ratios: dict[str, list[float]] = {}
    ratios_default: dict[str, list[float]] = {}
    acceptance: dict[str, list[float]] = {}  # kind/streams -> [draft tokens verified, accepted]
    with contextlib.ExitStack() as stack:
        # The servers up at once, measured in turns (the order rotating each round), so a drift in the
        # machine's speed over the run falls on all alike; the idle ones only wait.
        urls = {}
        servers = ("none", "default", args.method)
        for method in servers:
            port = free_port()
            cmd = pdserve_cmd() + ["serve", "--port", str(port)]
            cmd += ["--speculative-method", "none" if method == "default" else method]
            if method == "none":
                cmd.append("--batch-invariant")  # as drafts turn it on: both on one arithmetic
            if args.quantization:
                cmd += ["--quantization", args.quantization]
            if method == "draft":
                cmd += [
                    "--speculative-model",
                    args.speculative_model or "smollm2-135m",
                    "--speculative-quantization",
                    args.speculative_quantization,
                ]
            if method != "none":
                cmd += args.spec_arg
            srv = stack.enter_context(ServerProcess(cmd, port, log_dir / f"serve-{method}.log"))
            srv.wait_ready(timeout=600)
            _measure(srv.url, "open", 2, 1, 16)  # warm-up
            urls[method] = srv.url
        for kind in ("grounded", "open"):
            for streams in levels:
                for rnd in range(args.rounds):
                    tok_s = {}
                    turn = rnd % len(servers)
                    for method in servers[turn:] + servers[:turn]:
                        drafts = method == args.method
                        before = _spec_counts(urls[method]) if drafts else (0.0, 0.0)
                        rate, texts, failed = _measure(
                            urls[method], kind, streams, args.per_stream, args.max_tokens
                        )
                        if drafts:
                            after = _spec_counts(urls[method])
                            drafted = acceptance.setdefault(f"{kind}/{streams}", [0.0, 0.0])
                            drafted[0] += after[0] - before[0]
                            drafted[1] += after[1] - before[1]
                        tok_s[method] = rate
                        run = runs.setdefault(
                            f"{method}/{kind}/{streams}", {"tok_s": [], "texts": [], "failed": 0}
                        )
                        run["tok_s"].append(rate)
                        run["texts"] += texts
                        run["failed"] += failed
                    ratios.setdefault(f"{kind}/{streams}", []).append(tok_s[args.method] / tok_s["none"])
                    ratios_default.setdefault(f"{kind}/{streams}", []).append(
                        tok_s[args.method] / tok_s["default"]
                    )
    result: dict = {
        "benchmark": "spec_decode",
        "cpu": describe(),
        "deployment": "pdserve serve (PD, 1 prefill + 1 decode), smollm2-135m, greedy chat",
        "quantization": args.quantization or "auto",
        "method": args.method
        + (
            f" ({args.speculative_model or 'smollm2-135m'}, {args.speculative_quantization})"
            if args.method == "draft"
            else ""
        ),
    }
    ok = True
    for kind in ("grounded", "open"):
        for streams in levels:
            on, off = runs[f"{args.method}/{kind}/{streams}"], runs[f"none/{kind}/{streams}"]
            default = runs[f"default/{kind}/{streams}"]
            ratio = statistics.median(ratios[f"{kind}/{streams}"])
            vs_default = statistics.median(ratios_default[f"{kind}/{streams}"])
            same = sum(a == b for a, b in zip(on["texts"], off["texts"]))
            drafted, accepted = acceptance[f"{kind}/{streams}"]
            result[f"{kind}_{streams}"] = {
                f"tok_s_{args.method}": round(statistics.median(on["tok_s"]), 1),
                "tok_s_none": round(statistics.median(off["tok_s"]), 1),
                "ratio": round(ratio, 3),
                "ratios": [round(r, 3) for r in ratios[f"{kind}/{streams}"]],
                "tok_s_default": round(statistics.median(default["tok_s"]), 1),
                "ratio_vs_default": round(vs_default, 3),
                "ratios_vs_default": [round(r, 3) for r in ratios_default[f"{kind}/{streams}"]],
                "identical": f"{same}/{len(on['texts'])}",
                # the decode worker's verified draft tokens and the share of them accepted
                "draft_tokens": int(drafted),
                "acceptance": round(accepted / max(1.0, drafted), 3),
                "failed": on["failed"] + off["failed"] + default["failed"],
            }
            goal = 1.5 if kind == "grounded" and streams <= 8 else 0.95
            ok &= min(ratio, vs_default) >= goal and same == len(on["texts"])
            ok &= not (on["failed"] or off["failed"] or default["failed"])
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
