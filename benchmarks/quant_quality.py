"""Quality of each quantized mode against float32 on the default model.

32 chat prompts; float32 writes 64 greedy tokens for each; then float32 and each quantized mode are
teacher-forced over the same prompt + continuation, and at each of the 64 generated positions we
compare the next-token distributions: top-1 agreement and mean KL(float32 || mode). int4 serves the
GGUF file's own Q4_1 weights (no further loss), so only activation rounding (bfloat16 in the
kernels) and the int8 output head separate it from float32 over the same dequantized weights.
Prints one JSON line per mode. Goal: int4 agreement >= 0.97.

Each mode holds its KV cache as the engine would (cache.kv_dtype; --kv-dtype auto, the default:
bfloat16 for int4 and int8 weights, float32 for none), against the same float32 reference with a
float32 cache; --kv-dtype float32 or bfloat16 sets every mode's.

Then memory: the resident set of a fresh process holding the engine (weights and the same KV pool)
for float32 and each mode. Goal: int4's at least 60% of float32's weight bytes below float32's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TOPICS = [
    "the water cycle",
    "how a bicycle works",
    "photosynthesis",
    "the French revolution",
    "black holes",
    "how vaccines work",
    "the history of the internet",
    "why we sleep",
    "volcanoes",
    "the stock market",
    "machine learning",
    "the Roman empire",
    "climate change",
    "how airplanes fly",
    "the human heart",
    "the moon landing",
    "plate tectonics",
    "coffee",
    "the printing press",
    "electric cars",
    "honey bees",
    "the Great Wall of China",
    "rainbows",
    "DNA",
    "the Olympic games",
    "chess",
    "solar panels",
    "the piano",
    "earthquakes",
    "the Amazon rainforest",
    "recycling",
    "penguins",
]


_RSS_CHILD = """
import gc, json, sys
from pdserve import LLM
llm = LLM(model=sys.argv[2], quantization=sys.argv[1], device_blocks=256)
gc.collect()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
print(json.dumps({"rss_bytes": rss * 1024, "weight_bytes": llm.engine.weight_bytes}))
"""


def resident(mode: str, model: str) -> dict:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, mode, model], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--modes", default="int8,int4")
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="another model.name, e.g. a MoE one (tiny-mixtral: random weights)",
    )
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the modes' KV cache dtype (cache.kv_dtype; auto: as the engine resolves it for each mode); "
        "the reference keeps float32",
    )
    args = ap.parse_args()

    import torch

    from pdserve import LLM, SamplingParams
    from pdserve.bench.quality import agreement_and_kl, sequence_logits
    from pdserve.config import ModelConfig, load_config
    from pdserve.model.kv_dtype import resolve_kv_dtype
    from pdserve.model.loader import build_model, load_model_files
    from pdserve.utils.cpu import describe

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, threads=args.threads, prefix_cache=False, quantization="none")
    chats = [
        [{"role": "user", "content": f"Tell me about {t} in a short paragraph."}]
        for t in TOPICS[: args.prompts]
    ]
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True))
    seqs = [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outs]
    ref_model = llm.engine.model
    # Logits at positions p-1 .. end-1 predict the generated tokens.
    ref = [sequence_logits(ref_model, ids)[n - 1 : len(ids) - 1] for ids, n in seqs]
    del llm, ref_model
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        model = build_model(
            load_model_files(args.model, quantization=mode),
            "float32",
            model_config=ModelConfig(quantization=mode),
        )
        kv_name = resolve_kv_dtype(
            load_config(
                None, {"model.name": args.model, "model.quantization": mode, "cache.kv_dtype": args.kv_dtype}
            )
        )
        kv_dtype = getattr(torch, kv_name)
        got = [sequence_logits(model, ids, kv_dtype=kv_dtype)[n - 1 : len(ids) - 1] for ids, n in seqs]
        agree, kl = agreement_and_kl(torch.cat(ref), torch.cat(got))
        print(
            json.dumps(
                {
                    "benchmark": "quant_quality",
                    "mode": mode,
                    "kv_dtype": kv_name,
                    "model": args.model,
                    "cpu": describe(),
                    "prompts": len(seqs),
                    "steps": args.steps,
                    "top1_agreement": round(agree, 4),
                    "mean_kl": round(kl, 5),
                    "weight_bytes": model.weight_bytes(),
                    "seconds": round(time.perf_counter() - t0, 1),
                    "goal": ">= 0.97 agreement (int4)" if mode == "int4" else "reported",
                }
            ),
            flush=True,
        )
        del model
    base = resident("none", args.model)
    for mode in args.modes.split(","):
        r = resident(mode, args.model)
        below = base["rss_bytes"] - r["rss_bytes"]
        print(
            json.dumps(
                {
                    "benchmark": "quant_memory",
                    "mode": mode,
                    "cpu": describe(),
                    "rss_mb": round(r["rss_bytes"] / 1e6),
                    "float32_rss_mb": round(base["rss_bytes"] / 1e6),
                    "below_float32_mb": round(below / 1e6),
                    "fraction_of_float32_weight_bytes": round(below / base["weight_bytes"], 3),
                    "goal": ">= 0.6 (int4)" if mode == "int4" else "reported",
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
