"""The native product kernel by row count: microseconds per row of an int4 and an int8 product
against the float32 product of the same shape, in the same run, one thread (the kernel's own cost,
not the thread pool's). Shows where each path (rows in registers, the dequantized buffer, bfloat16
pairs where the CPU has them) pays, as a ratio: quantized ÷ float32 time, below 1 where the
quantized product is faster. Prints one JSON line.

`int4_a8` and `int8_a8` are int4 and int8 with the activations quantized to int8 per row
(model.activation_quantization: int8, qgemm_q8.c); `int4_a8_vs_int4` and `int8_a8_vs_int8` their
times against the float-activation kernels'.

Where the CPU has Intel AMX, `int4_amx_vs_avx512` and `int8_amx_vs_avx512` are the int4 and int8
times on AMX's tiles against the same products with the tiles turned off (the AVX512-BF16 paths),
for the row counts that take the tiles (qgemm.amx_rows).

The matrix is the default model's gate/up product (3072 x 576) by default: small enough to stay in
the last-level cache, so the figure is the kernel's arithmetic, not the memory's speed
(decode_roofline.py measures that).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,32")
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import torch

    from pdserve.model.kernels import qgemm
    from pdserve.model.linear import linear
    from pdserve.model.quant import pack
    from pdserve.utils.cpu import describe

    if not qgemm.available():
        print(json.dumps({"benchmark": "qgemm_rows", "error": "the native kernel does not build here"}))
        return 1
    from pdserve.model.kernels import tuning
    from pdserve.model.kernels.tuning import best_time

    tuning.tune()  # the paths this machine measured fastest, as a model load applies them
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.n, args.k, generator=g) * 0.05
    weights = {mode: pack(w, mode, torch.float32, "cpu", native=True) for mode in ("none", "int8", "int4")}
    # With the activations quantized to int8 (model.activation_quantization: int8).
    for mode in ("int8", "int4"):
        weights[f"{mode}_a8"] = pack(w, mode, torch.float32, "cpu", native=True, activations="int8")

    result: dict = {
        "benchmark": "qgemm_rows",
        "cpu": describe(),
        "shape": [args.n, args.k],
        "threads": args.threads,
        "int8_activation_kernel": qgemm.q8_variant(),
        "amx": qgemm.amx(),
    }
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.k, generator=g)
        us = {m: best_time(lambda: linear(x, wt), args.repeats, 20) * 1e6 for m, wt in weights.items()}
        tiled = [m for m in ("int4", "int8") if 0 < qgemm.amx_rows(m) <= rows]
        qgemm.amx(False)
        try:
            off = {m: best_time(lambda: linear(x, weights[m]), args.repeats, 20) * 1e6 for m in tiled}
        finally:
            qgemm.amx(True)
        amx = {f"{m}_amx_vs_avx512": round(us[m] / off[m], 3) for m in off}
        result[f"rows_{rows}"] = {
            "us_per_row": {m: round(t / rows, 1) for m, t in us.items()},
            "int4_vs_f32": round(us["int4"] / us["none"], 3),
            "int8_vs_f32": round(us["int8"] / us["none"], 3),
            "int4_a8_vs_int4": round(us["int4_a8"] / us["int4"], 3),
            "int8_a8_vs_int8": round(us["int8_a8"] / us["int8"], 3),
            **amx,
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
