"""Concurrency under KV pressure: a preempted request swapped to host RAM against one recomputed.

The offline engine on the default model, with a KV pool too small for the batch it admits: the
replies outgrow the pool, so the newest requests are preempted again and again. The same
requests run in one process, on one copy of the weights: with swap space (`cache.swap_space_gb`,
the default) and without (0: recompute), each with the prefix cache on (the default: a recomputed
request finds its blocks that were not evicted yet) and off. Greedy, `ignore_eos`, so every run
produces the same tokens (checked). Swap and recompute alternate for `--rounds` rounds, each on a
fresh engine, and each keeps its best round: the machine is shared.

Prints one JSON line: per prefix-cache setting, output tok/s of each (and per CPU-second of this
process, steadier when others share the cores), swap / recompute,
preemptions, requests swapped, the positions computed again, the time spent copying KV; and the
CPU the figure comes from.
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


def run(
    files,
    model: str,
    prompts: list[list[int]],
    params: SamplingParams,
    blocks: int,
    swap_gb: float,
    prefix_cache: bool,
    threads: int | None,
) -> dict:
    llm = LLM(
        model=model,
        loaded=files,
        device_blocks=blocks,
        cache__swap_space_gb=swap_gb,
        prefix_cache=prefix_cache,
        threads=threads,
    )
    llm.generate("Warm up.", SamplingParams(temperature=0, max_tokens=4))  # shares no prefix with the prompts
    eng = llm.engine
    base = eng.stats()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = eng.stats()
    assert eng.pool.num_free == eng.pool.num_blocks, "the pool did not come back"
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "outputs": [o.token_ids for o in outs],
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
        "cpu_s": round(cpu, 2),
        "output_tok_per_cpu_s": round(tokens / cpu, 1),
        "preemptions": s["preemptions_total"] - base["preemptions_total"],
        "swapped": s.get("swapped_out_total", 0),
        "swap_fallbacks": s.get("swap_fallbacks_total", 0),
        "swap_s": round(s.get("swap_seconds_total", 0.0), 3),
        "recomputed_tokens": s["recomputed_tokens_total"] - base["recomputed_tokens_total"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    # Short prompts, long replies: all twelve are admitted on their prompts' blocks and their decodes
    # outgrow the pool (6 preemptions, ~60 positions each to recompute). Longer prompts recompute
    # more per preemption but take minutes on two shared cores.
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-words", type=int, default=28, help="about 1.1 tokens per word")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--blocks", type=int, default=40, help="KV pool in 16-token blocks (small: forces preemption)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    files = load_model_files(a.model)
    rng = random.Random(a.seed)
    prompts = [files.tokenizer.encode(words(rng, a.prompt_words)) for _ in range(a.requests)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    result: dict = {
        "benchmark": "swap_preemption",
        "model": a.model,
        "cpu": describe(),
        "requests": a.requests,
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts)),
        "max_tokens": a.max_tokens,
        "kv_blocks": a.blocks,
    }
    outputs = []
    for pc in (True, False):
        runs: dict[str, list[dict]] = {"recompute": [], "swap": []}
        for i in range(a.rounds):
            for mode in ("recompute", "swap") if i % 2 == 0 else ("swap", "recompute"):
                runs[mode].append(
                    run(
                        files,
                        a.model,
                        prompts,
                        params,
                        a.blocks,
                        1.0 if mode == "swap" else 0.0,
                        pc,
                        a.threads,
                    )
                )
        outputs += [r.pop("outputs") for rs in runs.values() for r in rs]
        recompute, swap = (
            max(rs, key=lambda r: r["output_tok_s"]) for rs in (runs["recompute"], runs["swap"])
        )
        result["prefix_cache_on" if pc else "prefix_cache_off"] = {
            "swap": swap,
            "recompute": recompute,
            "swap_over_recompute": round(swap["output_tok_s"] / recompute["output_tok_s"], 2),
            # Less sensitive to other processes on a shared machine than wall time.
            "swap_over_recompute_cpu": round(
                swap["output_tok_per_cpu_s"] / recompute["output_tok_per_cpu_s"], 2
            ),
        }
    result["same_tokens"] = all(o == outputs[0] for o in outputs)
    print(json.dumps(result))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
