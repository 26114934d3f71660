"""Expert parallelism's decode step: data-parallel attention with all-to-all against replicated
attention with an all-reduce, and against one process with every thread.

A scaled random MoE model (Mixtral-shaped: hidden 512, 8 layers, 16 experts top-2, GQA 8/4 heads) and
32 sequences at context 2,048 in a KV pool in /dev/shm that every rank maps, as an EP worker's engine
allocates it. Three setups run the same decode step, each timed for --steps steps after a warm-up:

- ep1: one process, --threads threads (the cores EP=2 uses);
- replicated: EP=2, one thread per rank, every rank attends all 32 sequences and sums the MoE outputs
  with an all-reduce of every token's hidden state (model.ep_attention replicated);
- data: EP=2, one thread per rank, each rank attends its own share of the sequences and a MoE layer
  sends a token only to the other rank when one of its experts lives there (model.ep_attention data).

- overlap: data, each rank's share as two micro-batches whose exchanges overlap the other's compute
  (model.ep_overlap).

The same four run a prefill step too (--prefill-sequences chunks of --prefill-chunk tokens), where a
rank's experts see many tokens each and a second read of them costs relatively less.

Prints one JSON line: steps per second and tokens per second of each, data ÷ replicated (goal >= 1.4)
and data ÷ ep1 (goal >= 0.85), overlap ÷ data (on ÷ off) for decode and prefill; the bytes rank 0
sent per MoE layer per step against the all-reduce's payload; the attended KV per rank, max ÷ mean
(goal <= 1.1). A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 16


def scaled_arch(layers: int, experts: int, hidden: int):
    from pdserve.model.arch import ModelArch

    return ModelArch(
        architecture="mixtral",
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=4,
        head_dim=hidden // 8,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
    )


def run(setup: str, arch, weights, args, kind: str = "decode") -> dict:
    import torch

    from pdserve.cache.kv_cache import allocate_kv_cache, new_shm_path
    from pdserve.config import ModelConfig
    from pdserve.model.attention import build_metadata
    from pdserve.model.dp_attention import split_step, token_cost
    from pdserve.model.loader import LoadedModel, build_model

    ep = 1 if setup == "ep1" else 2
    torch.set_num_threads(args.threads if ep == 1 else 1)  # the ranks inherit it: one thread each
    mc = ModelConfig(
        expert_parallel=ep,
        ep_attention="replicated" if setup == "replicated" else "data",
        ep_overlap=setup == "overlap",
    )
    model = build_model(LoadedModel("wide-ep-bench", arch, weights, None), model_config=mc)
    rows, ctx = args.sequences, args.context
    per = -(-(ctx + 1) // BLOCK)
    path = new_shm_path()
    try:
        kv = allocate_kv_cache(arch, rows * per, BLOCK, torch.float32, "cpu", path)
        g = torch.Generator().manual_seed(0)
        kv.copy_(torch.randn(kv.shape, generator=g) * 0.1)
        if ep > 1:
            model.share_kv_cache(kv, str(path))
        if kind == "decode":
            seqs = [(list(range(r * per, (r + 1) * per)), ctx, 1) for r in range(rows)]
            pos = torch.full((rows,), ctx)
            last = torch.arange(rows)
        else:  # a chunk per sequence from position 0, each wanting its last row's logits
            n, c = args.prefill_sequences, args.prefill_chunk
            seqs = [(list(range(r * per, (r + 1) * per)), 0, c) for r in range(n)]
            pos = torch.arange(c).repeat(n)
            last = torch.arange(n) * c + c - 1
            rows = n * c
        meta = build_metadata(seqs, BLOCK, arch.sliding_window, "cpu")
        ids = torch.randint(0, arch.vocab_size, (rows,), generator=g)

        def step():
            model.forward(ids, pos, meta, kv, last)

        for _ in range(2):
            step()
        ex = getattr(model, "exchange", None)
        sent0 = ex.dispatch_bytes if ex is not None else 0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        out = {"setup": setup, "kind": kind, "step_ms": round(sec * 1e3, 2), "tok_s": round(rows / sec, 1)}
        if setup == "data" and kind == "decode":
            moe_layers = len(model.model.moe_ids)
            out["rank0_sent_bytes_per_layer_step"] = round(
                (ex.dispatch_bytes - sent0) / (args.steps * moe_layers)
            )
            out["allreduce_payload_bytes_per_layer"] = rows * arch.hidden_size * 4
            shares = split_step(meta, rows, last, 2, token_cost(arch))
            kvs = [s.attended for s in shares]
            out["attended_kv_per_rank"] = kvs
            out["attended_max_over_mean"] = round(max(kvs) / (sum(kvs) / len(kvs)), 3)
        return out
    finally:
        close = getattr(model, "close", None)
        if close is not None:
            close()
        path.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-process baseline")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prefill-sequences", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=256, help="tokens of each prefill chunk")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="each setup this many times, alternating")
    args = ap.parse_args()

    from pdserve.model.loader import tiny_random_weights
    from pdserve.utils.cpu import describe

    arch = scaled_arch(args.layers, args.experts, args.hidden)
    weights = tiny_random_weights(arch, 0)
    results: dict[str, list[dict]] = {"ep1": [], "replicated": [], "data": [], "overlap": []}
    prefill: dict[str, list[dict]] = {"data": [], "overlap": []}
    for _ in range(args.rounds):
        for setup in results:
            results[setup].append(run(setup, arch, weights, args))
            print(json.dumps(results[setup][-1]), file=sys.stderr, flush=True)
        for setup in prefill:
            prefill[setup].append(run(setup, arch, weights, args, "prefill"))
            print(json.dumps(prefill[setup][-1]), file=sys.stderr, flush=True)
    tok = {s: statistics.median(r["tok_s"] for r in rs) for s, rs in results.items()}
    ptok = {s: statistics.median(r["tok_s"] for r in rs) for s, rs in prefill.items()}
    data = results["data"][-1]
    print(
        json.dumps(
            {
                "benchmark": "wide_ep",
                "cpu": describe(),
                "model": {
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "experts": args.experts,
                    "top_k": 2,
                    "sequences": args.sequences,
                    "context": args.context,
                    "prefill": f"{args.prefill_sequences} x {args.prefill_chunk} tokens",
                },
                "tok_s": tok,
                "step_ms": {s: statistics.median(r["step_ms"] for r in rs) for s, rs in results.items()},
                "data_over_replicated": round(tok["data"] / tok["replicated"], 3),
                "data_over_ep1": round(tok["data"] / tok["ep1"], 3),
                "overlap_over_data": round(tok["overlap"] / tok["data"], 3),
                "prefill_tok_s": ptok,
                "prefill_overlap_over_data": round(ptok["overlap"] / ptok["data"], 3),
                "rank0_sent_bytes_per_layer_step": data["rank0_sent_bytes_per_layer_step"],
                "allreduce_payload_bytes_per_layer": data["allreduce_payload_bytes_per_layer"],
                "attended_max_over_mean": data["attended_max_over_mean"],
                "goals": {"data_over_replicated": ">= 1.4", "data_over_ep1": ">= 0.85", "attended": "<= 1.1"},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
