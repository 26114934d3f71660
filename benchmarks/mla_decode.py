"""Multi-head latent attention decode: a step with the up-projections absorbed into the query and the
output (what pdserve runs) against the same step expanding every cached latent to per-head K and V,
at one context length, on a scaled random MLA model (DeepSeek-V2-Lite's attention shape by default:
16 heads, kv_lora_rank 512, qk 128 + 64 rope, v 128, hidden 2048). Prints one JSON line with the
ratio absorbed ÷ expanded (below 1: absorption is faster) and how far apart the two steps' logits are;
the absorbed step runs the native paged kernel (float32 CPU) where it builds, and is also timed with
torch's products over gathered rows (absorbed_torch_ms).

Both steps read the same paged KV cache of latent rows, filled by one prefill of the context; the
decode of the next token is then timed alternately in the two modes, the median of each reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="decodes in the step, each at --context")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--q-lora-rank", type=int, default=0, help="0: q_proj (V2-Lite); V3 uses 1536")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per mode")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()

    import torch

    from pdserve.model.arch import ModelArch
    from pdserve.model.attention import build_metadata
    from pdserve.model.llama import LlamaModel
    from pdserve.model.loader import tiny_random_weights
    from pdserve.utils.cpu import describe

    if args.threads:
        torch.set_num_threads(args.threads)
    ctx, bs, n = args.context, 16, args.batch
    arch = ModelArch(
        architecture="deepseek_v2",
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=1408,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.heads,
        head_dim=192,
        rms_norm_eps=1e-6,
        max_position_embeddings=ctx + 16,
        tie_word_embeddings=False,
        kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.q_lora_rank or None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
    )
    model = LlamaModel(arch, tiny_random_weights(arch, 0), torch.float32)
    blocks_per_seq = -(-(ctx + 1) // bs)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(n)]
    kv = torch.zeros(arch.kv_cache_shape(n * blocks_per_seq * bs))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (ctx,), generator=g) for _ in range(n)]
    for table, ids in zip(tables, prompts):  # fill the cache: each context in one prefill
        meta = build_metadata([(table, 0, ctx)], bs, None, "cpu")
        model.forward(ids, torch.arange(ctx), meta, kv, None)
    ids = torch.randint(0, arch.vocab_size, (n,), generator=g)
    positions = torch.full((n,), ctx)
    meta = build_metadata([(t, ctx, 1) for t in tables], bs, None, "cpu")
    rows = torch.arange(n)

    kernel = model.layers[0].decode_kernel
    modes = {"absorbed": (True, kernel), "expanded": (False, kernel), "absorbed_torch": (True, None)}

    def step(mode: str) -> tuple[float, torch.Tensor]:
        for layer in model.layers:
            layer.absorb, layer.decode_kernel = modes[mode]
        t0 = time.perf_counter()
        logits = model.forward(ids, positions, meta, kv, rows)
        return time.perf_counter() - t0, logits

    times: dict[str, list[float]] = {mode: [] for mode in modes}
    logits = {mode: step(mode)[1] for mode in modes}  # warm up
    for _ in range(args.steps):
        for mode in modes:  # alternate, so that drift on a shared machine hits every mode alike
            times[mode].append(step(mode)[0])
    absorbed, expanded = statistics.median(times["absorbed"]), statistics.median(times["expanded"])
    ref = logits["expanded"].double()
    print(
        json.dumps(
            {
                "benchmark": "mla_decode",
                "cpu": describe(),
                "threads": torch.get_num_threads(),
                "context": ctx,
                "batch": n,
                "layers": args.layers,
                "heads": args.heads,
                "kv_lora_rank": args.kv_lora_rank,
                "kv_bytes_per_token_layer": (arch.kv_lora_rank + arch.qk_rope_head_dim) * 4,
                "native_kernel": kernel is not None,
                "absorbed_ms": round(absorbed * 1e3, 2),
                "expanded_ms": round(expanded * 1e3, 2),
                "absorbed_torch_ms": round(statistics.median(times["absorbed_torch"]) * 1e3, 2),
                "absorbed_vs_expanded": round(absorbed / expanded, 3),
                "speedup": round(expanded / absorbed, 2),
                "max_logit_diff_rel": max(
                    float((logits[m].double() - ref).abs().max() / ref.abs().max()) for m in modes
                ),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
