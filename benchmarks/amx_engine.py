"""The default model (its Q4_1 file served as int4) with Intel AMX's tiles against the same engine with
them turned off (the AVX512-BF16 pairs from 9 rows, the float32 kernel below), in one process, one run:
what the tiles give a prefill and decode steps. Prints one JSON line.

- prefill: prompts of `--prompt` fresh random token ids (no cache hit), max_tokens 1; the median
  time of `--trials` prompts each way, alternating.
- decode: `--streams` prompts of 64 tokens decoding `--tokens` each (ignore_eos), output tokens per
  second each way, alternating; and the share of greedy outputs the two ways agree on whole (from 9
  streams both round the same operands to bfloat16 and the sums go in another order; below, the
  float32 kernel does not round the activations).
Figures: tiles ÷ off, time (prefill, below 1 is faster) and tok/s (decode, above 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--streams", default="16,32,64")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()

    from pdserve import LLM, SamplingParams
    from pdserve.model.kernels import qgemm
    from pdserve.utils.cpu import describe

    llm = LLM(model="smollm2-135m")
    out: dict = {
        "benchmark": "amx_engine",
        "cpu": describe(),
        "quantization": llm.config.model.quantization,
        "amx": qgemm.amx(),
        "int4_tiles_from_rows": qgemm.amx_rows("int4"),
    }
    if not out["amx"]:
        out["error"] = "no AMX tiles here (the CPU, the build or the kernel's permission)"
        print(json.dumps(out))
        return 1
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(fresh(args.prompt), one)  # warm-up: kernels built, buffers sized
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.trials):
        for on in (True, False):
            qgemm.amx(on)
            prompt = fresh(args.prompt)
            t0 = time.perf_counter()
            llm.generate(prompt, one)
            times[on].append(time.perf_counter() - t0)
    qgemm.amx(True)
    pre = {on: statistics.median(ts) for on, ts in times.items()}
    out["prefill"] = {
        "prompt_tokens": args.prompt,
        "tiles_s": round(pre[True], 4),
        "pairs_s": round(pre[False], 4),
        "tiles_vs_pairs": round(pre[True] / pre[False], 3),
    }
    for streams in (int(s) for s in args.streams.split(",")):
        prompts = [fresh(64) for _ in range(streams)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        rates: dict[bool, list[float]] = {True: [], False: []}
        texts: dict[bool, list[list[int]]] = {}
        for _ in range(2):
            for on in (True, False):
                qgemm.amx(on)
                t0 = time.perf_counter()
                got = llm.generate(prompts, params)
                rates[on].append(streams * args.tokens / (time.perf_counter() - t0))
                texts[on] = [g.token_ids for g in got]
        qgemm.amx(True)
        best = {on: max(r) for on, r in rates.items()}
        out[f"decode_{streams}"] = {
            "tiles_tok_s": round(best[True], 1),
            "pairs_tok_s": round(best[False], 1),
            "tiles_vs_pairs": round(best[True] / best[False], 3),
            "same_greedy_outputs": f"{sum(a == b for a, b in zip(texts[True], texts[False]))}/{streams}",
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
