"""Concurrency under KV pressure: a preempted request swapped to host RAM against one recomputed.

The offline engine on the default model, with a KV pool too small for the batch it admits: every
request starts with its prompt's blocks, then outgrows the pool while decoding, so the newest ones
are preempted again and again. The same requests run twice in one process, on one copy of the
weights: with swap space (`cache.swap_space_gb`, the default) and without (0: recompute). Greedy,
`ignore_eos`, so both runs produce the same tokens (checked). The two alternate for `--rounds`
rounds, each on a fresh engine, and each keeps its best round: the machine is shared.

Prints one JSON line: output tok/s of each, swap / recompute, preemptions, requests swapped, the
positions computed again, the time spent copying KV, and the CPU the figure comes from.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.bench.workloads import words  # noqa: E402
from pdserve.model.loader import load_model_files  # noqa: E402
from pdserve.utils.cpu import describe  # noqa: E402


def run(files, model: str, prompts: list[list[int]], params: SamplingParams, blocks: int, swap_gb: float,
        threads: int | None) -> dict:
    llm = LLM(model=model, loaded=files, device_blocks=blocks, cache__swap_space_gb=swap_gb, threads=threads)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))        # warm-up, no preemption
    eng = llm.engine
    base = eng.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    s = eng.stats()
    assert eng.pool.num_free == eng.pool.num_blocks, "the pool did not come back"
    tokens = sum(len(o.token_ids) for o in outs)
    return {"outputs": [o.token_ids for o in outs], "wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 1),
            "preemptions": s["preemptions_total"] - base["preemptions_total"],
            "swapped": s.get("swapped_out_total", 0), "swap_fallbacks": s.get("swap_fallbacks_total", 0),
            "swap_s": round(s.get("swap_seconds_total", 0.0), 3),
            "recomputed_tokens": s["recomputed_tokens_total"] - base["recomputed_tokens_total"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    # Short prompts, long replies: the batch is admitted on its prompts' blocks and its decodes
    # outgrow the pool over and over (about 6 preemptions here, each ~50-60 positions to recompute).
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-words", type=int, default=28, help="about 1.2 tokens per word")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=40, help="KV pool in 16-token blocks (small: forces preemption)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    files = load_model_files(a.model)
    rng = random.Random(a.seed)
    prompts = [files.tokenizer.encode(words(rng, a.prompt_words)) for _ in range(a.requests)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    runs: dict[str, list[dict]] = {"recompute": [], "swap": []}
    for i in range(a.rounds):
        for mode in ("recompute", "swap") if i % 2 == 0 else ("swap", "recompute"):
            runs[mode].append(run(files, a.model, prompts, params, a.blocks, 1.0 if mode == "swap" else 0.0,
                                  a.threads))
    outputs = [r.pop("outputs") for rs in runs.values() for r in rs]
    same = all(o == outputs[0] for o in outputs)
    recompute, swap = (max(rs, key=lambda r: r["output_tok_s"]) for rs in (runs["recompute"], runs["swap"]))
    print(json.dumps({
        "benchmark": "swap_preemption", "model": a.model, "cpu": describe(), "requests": a.requests,
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts)), "max_tokens": a.max_tokens,
        "kv_blocks": a.blocks, "swap": swap, "recompute": recompute,
        "swap_over_recompute": round(swap["output_tok_s"] / recompute["output_tok_s"], 2), "same_tokens": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
