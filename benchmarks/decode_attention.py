"""Decode attention over the paged KV cache at serving shapes, measured in one run: the native kernel
(`model/kernels/decode_attention.c`) against torch's path (each sequence's blocks gathered into a
padded batch for `scaled_dot_product_attention`), and against the read roofline (the KV bytes a step
reads ÷ the machine's read bandwidth, measured here with the same threads).

At 32 streams of a few hundred tokens a decode step reads more bytes of keys and values than of int4
weights, so attention is a large share of the step and bound by what it reads. Each case holds
`--layers` layers' caches with its sequences' blocks scattered over them, as a served pool does, so
one pass over the layers streams from memory as a step does. The kernel and torch's path alternate in
rounds; each reports its median round.

    python benchmarks/decode_attention.py [--cases 32x256,8x1024,4x2048,1x4096] [--shape smollm2]

Prints a table and one JSON line: per case and KV dtype, ms per layer, torch ÷ kernel, and the
fraction of the read roofline the kernel reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Spinning between calls: in a served decode step the kernel runs inside the step's one parallel
# region (layer.c), so a sleeping thread's wake-up per call (PASSIVE) would be counted here only.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_roofline import bandwidths  # noqa: E402

# Query heads, KV heads, head dimension of the models compare.py serves.
SHAPES = {"smollm2": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "qwen2.5-0.5b": (14, 2, 64)}


def _case(torch, streams: int, ctx: int, shape, dtype, layers: int, block: int, seed: int):
    """Query rows, one new key and value per stream, `layers` caches and the step's metadata."""
    from pdserve.model.attention import build_metadata

    h, kvh, d = shape
    g = torch.Generator().manual_seed(seed)
    per = -(-ctx // block)
    blocks = streams * per + 16
    caches = [
        (
            torch.randn(blocks * block, kvh, d, generator=g).to(dtype),
            torch.randn(blocks * block, kvh, d, generator=g).to(dtype),
        )
        for _ in range(layers)
    ]
    perm = torch.randperm(blocks, generator=g).tolist()
    seqs = [(perm[i * per : (i + 1) * per], ctx - 1, 1) for i in range(streams)]
    meta = build_metadata(seqs, block, None, "cpu")
    q = torch.randn(streams, h, d, generator=g)
    k, v = torch.randn(streams, kvh, d, generator=g), torch.randn(streams, kvh, d, generator=g)
    return q, k, v, caches, meta


def _torch_pass(q, k, v, caches, meta) -> tuple[float, object]:
    """torch's path over every layer (its gather included): seconds per layer, the last output."""
    from pdserve.model.attention import paged_attention

    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    for kc, vc in caches:
        out = paged_attention(q, k, v, kc, vc, meta, scale)
    return (time.perf_counter() - t0) / len(caches), out


def _kernel_pass(kernel, q, caches, meta, out) -> tuple[float, object]:
    """The kernel over every layer, called as the fused decode step calls it (its arguments built
    once a step, no writes of the new keys: torch's path has those too, and they are a row a stream)."""
    (g,) = meta.decode_groups
    first, ctx = g.attended()
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    for kc, vc in caches:
        kernel(q, kc, vc, g.block_idx, first, ctx, meta.block_size, scale, out)
    return (time.perf_counter() - t0) / len(caches), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cases", default="32x256,8x1024,4x2048,1x4096", help="streams x context, comma-separated"
    )
    ap.add_argument(
        "--shape", default="smollm2", choices=sorted(SHAPES), help="the attention heads of this model"
    )
    ap.add_argument("--kv-dtypes", default="float32,bfloat16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import torch

    from pdserve.model.kernels.decode_attention import decode_attention_kernel
    from pdserve.utils.cpu import describe

    torch.set_num_threads(args.threads)
    kernel = decode_attention_kernel()
    if kernel is None:
        print("no C compiler: the native kernel cannot be built here", file=sys.stderr)
        return 1
    shape = SHAPES[args.shape]
    rows, bws = [], []
    for spec in args.cases.split(","):
        streams, ctx = (int(x) for x in spec.lower().split("x"))
        for name in args.kv_dtypes.split(","):
            dtype = getattr(torch, name)
            q, k, v, caches, meta = _case(
                torch, streams, ctx, shape, dtype, args.layers, args.block_size, len(rows)
            )

            read_bw = bandwidths()[1]  # per case: the VM's memory speed drifts
            bws.append(read_bw)
            times: dict[str, list[float]] = {"kernel": [], "torch": []}
            outs = {}
            for r in range(args.rounds + 1):
                for way in ("kernel", "torch") if r % 2 == 0 else ("torch", "kernel"):
                    if way == "kernel":
                        t, outs[way] = _kernel_pass(kernel, q, caches, meta, torch.empty_like(q))
                    else:
                        t, outs[way] = _torch_pass(q, k, v, caches, meta)
                    if r:  # the first round builds buffers and warms the caches
                        times[way].append(t)
            kt, tt = statistics.median(times["kernel"]), statistics.median(times["torch"])
            kv_bytes = 2 * streams * ctx * shape[1] * shape[2] * dtype.itemsize
            rows.append(
                {
                    "streams": streams,
                    "context": ctx,
                    "kv_dtype": name,
                    "kv_mb_per_layer": round(kv_bytes / 1e6, 2),
                    "kernel_ms": round(kt * 1e3, 3),
                    "torch_ms": round(tt * 1e3, 3),
                    "torch_over_kernel": round(tt / kt, 2),
                    "read_gbps": round(read_bw / 1e9, 1),
                    "read_roofline": round(kv_bytes / read_bw / kt, 2),
                    "max_abs_diff": float((outs["kernel"] - outs["torch"]).abs().max()),
                }
            )
            del caches
    print(
        f"{describe()}, {args.threads} threads, read bandwidth {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} GB/s, {args.shape} {shape}"
    )
    print(
        f"{'case':>9} {'kv':>8} {'MB/layer':>9} {'kernel ms':>10} {'torch ms':>9} {'torch/kernel':>13} {'roofline':>9}"
    )
    for r in rows:
        print(
            f"{r['streams']:>3}x{r['context']:<5} {r['kv_dtype']:>8} {r['kv_mb_per_layer']:>9} {r['kernel_ms']:>10} "
            f"{r['torch_ms']:>9} {r['torch_over_kernel']:>13} {r['read_roofline']:>9}"
        )
    print(
        json.dumps(
            {
                "cpu": describe(),
                "threads": args.threads,
                "shape": args.shape,
                "cases": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
