"""The default model (its Q4_1 file served as int4) with the kernel paths this machine measured fastest
(kernels/tuning.py: where the exact path and the rounded tile start, on AMX's tiles or the AVX512-BF16
pairs, and where int4's register rows look their nibbles up) against the kernel's unmeasured starts,
in one process, one run. Prints one JSON line.

- decode: `--streams` prompts of 64 tokens decoding `--tokens` each (ignore_eos), output tokens per
  second each way, alternating, the best of `--rounds` each;
- prefill: a `--prompt`-token prompt of fresh token ids (no cache hit), max_tokens 1, the median of
  `--trials` each way.
Figures: measured ÷ unmeasured, tok/s (decode, above 1 is faster) and time (prefill, below 1 is faster).
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
    ap.add_argument("--streams", default="2,4,6,8,16,32,48")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()

    from pdserve import LLM, SamplingParams
    from pdserve.model.kernels import tuning
    from pdserve.utils.cpu import describe

    llm = LLM(model="smollm2-135m")
    chosen = tuning.tune()  # the loader applied it already: here, what it chose
    out: dict = {
        "benchmark": "kernel_tuning",
        "cpu": describe(),
        "quantization": llm.config.model.quantization,
    }
    if not chosen:
        out["error"] = "no kernel choice here: nothing is measured"
        print(json.dumps(out))
        return 1
    paths = tuning.machine_choices()
    out["measured"] = {c.key: chosen[c.key] for c in paths}
    out["unmeasured"] = {c.key: c.unmeasured for c in paths}

    def use(measured: bool) -> None:
        for c in paths:
            c.set_start(chosen[c.key] if measured else c.unmeasured)

    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(fresh(args.prompt), one)  # warm-up: kernels built, buffers sized
    for streams in (int(s) for s in args.streams.split(",")):
        prompts = [fresh(64) for _ in range(streams)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for measured in (True, False):
                use(measured)
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                rates[measured].append(streams * args.tokens / (time.perf_counter() - t0))
        best = {m: max(r) for m, r in rates.items()}
        out[f"decode_{streams}"] = {
            "measured_tok_s": round(best[True], 1),
            "unmeasured_tok_s": round(best[False], 1),
            "measured_vs_unmeasured": round(best[True] / best[False], 3),
        }
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.trials):
        for measured in (True, False):
            use(measured)
            prompt = fresh(args.prompt)
            t0 = time.perf_counter()
            llm.generate(prompt, one)
            times[measured].append(time.perf_counter() - t0)
    use(True)
    pre = {m: statistics.median(ts) for m, ts in times.items()}
    out["prefill"] = {
        "prompt_tokens": args.prompt,
        "measured_s": round(pre[True], 4),
        "unmeasured_s": round(pre[False], 4),
        "measured_vs_unmeasured": round(pre[True] / pre[False], 3),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
