"""A MoE decode step against its memory floor, and int4's step against float32's, on a scaled random
MoE model (Mixtral-shaped: 32 experts, top-4, hidden 1024, expert width 512, 4 layers).

A decode step reads the dense weights (attention, router, output head), every expert that at least
one of its rows chose (each once: kernels/moe.c runs an expert's rows together), and the rows' KV.
Those bytes ÷ the copy bandwidth measured in the same process (`Tensor.copy_` of 1 GiB, as
decode_roofline.py) is the step's floor. For 8 and 32 decode rows and each of float32, int8 and int4
the script prints the median step, the bytes it read, and step ÷ floor (goal: <= 1.3); then int4's
step ÷ float32's (goal: <= 0.5), and the step with the experts run slot by slot (the torch loop,
model/moe.py `routed_experts_loop`) ÷ with the grouped kernel. Every case and both paths are timed in
each of 5 rounds beside that round's bandwidth; medians of the rounds. One JSON line. About a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CONTEXT = 64  # tokens of each row's sequence already in the KV cache
BLOCK = 16


def scaled_arch():
    from pdserve.model.arch import ModelArch

    return ModelArch(
        architecture="mixtral",
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2048,
        num_layers=4,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
    )


def _copy_bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    import torch

    n = int(gib * (1 << 30)) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


class _Step:
    """`rows` decodes at context CONTEXT, run repeatedly on one KV cache (the same tokens each time:
    the weights read do not depend on the step's position)."""

    def __init__(self, model, rows: int, seed: int) -> None:
        import torch

        from pdserve.model.attention import build_metadata

        a = model.arch
        per = (CONTEXT + 1 + BLOCK - 1) // BLOCK
        self.model = model
        self.kv = torch.randn(a.kv_cache_shape(rows * per * BLOCK)) * 0.1
        seqs = [(list(range(r * per, (r + 1) * per)), CONTEXT, 1) for r in range(rows)]
        self.meta = build_metadata(seqs, BLOCK, a.sliding_window, "cpu")
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, a.vocab_size, (rows,), generator=g)
        self.pos = torch.full((rows,), CONTEXT)
        self.last = torch.arange(rows)
        self.kv_bytes = rows * (CONTEXT + 1) * a.num_layers * 2 * a.kv_size * 4

    def __call__(self) -> None:
        self.model.forward(self.ids, self.pos, self.meta, self.kv, self.last)

    def seconds(self, steps: int) -> float:
        self()  # warm: the previous case's weights evicted this one's from the caches
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def bytes_read(self) -> int:
        """Dense weights + the experts this step's rows chose (each once per layer) + the KV read."""
        m = self.model.model
        chosen: dict[int, set[int]] = {}
        m.set_load_hook(lambda layer, ids: chosen.setdefault(layer, set()).update(ids.flatten().tolist()))
        try:
            self()
        finally:
            m.set_load_hook(None)
        experts = sum(b.placement.gate_up.nbytes + b.placement.down.nbytes for b in m.blocks)
        per_expert = experts // (len(m.blocks) * m.num_physical)
        active = sum(len(s) for s in chosen.values())
        return m.weight_bytes() - experts + active * per_expert + self.kv_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="rounds over every case (medians)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case and path in a round")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument(
        "--activations", default="none", help="model.activation_quantization of the int8 and int4 cases"
    )
    args = ap.parse_args()

    import torch

    from pdserve.config import ModelConfig
    from pdserve.model import moe
    from pdserve.model.loader import LoadedModel, build_model, tiny_random_weights
    from pdserve.utils.cpu import describe

    torch.set_num_threads(args.threads)
    arch = scaled_arch()
    weights = tiny_random_weights(arch, 0)
    rows_list = [int(r) for r in args.rows.split(",")]
    modes = ("none", "int8", "int4")
    cases = {}
    for mode in modes:
        model = build_model(
            LoadedModel("moe-decode-bench", arch, weights, None),
            model_config=ModelConfig(
                quantization=mode, activation_quantization="none" if mode == "none" else args.activations
            ),
        )
        for rows in rows_list:
            step = _Step(model, rows, seed=rows)
            cases[(mode, rows)] = (step, step.bytes_read())
    del weights
    kernel = moe.routed_experts
    # The machine's speed drifts: every case and both paths are timed in each round, beside that
    # round's copy bandwidth, and each ratio is the median of its rounds' ratios.
    per: dict[tuple[str, int], dict[str, list[float]]] = {
        c: {"step": [], "floor": [], "loop": []} for c in cases
    }
    bws = []
    for _ in range(args.rounds):
        bw = _copy_bandwidth()
        bws.append(bw)
        for c, (step, read) in cases.items():
            seconds = step.seconds(args.steps)
            moe.routed_experts = moe.routed_experts_loop  # the slot-by-slot path, for the ratio only
            try:
                loop = step.seconds(args.steps)
            finally:
                moe.routed_experts = kernel
            per[c]["step"].append(seconds)
            per[c]["floor"].append(seconds / (read / bw))
            per[c]["loop"].append(loop / seconds)
    med = statistics.median
    out: dict = {
        "benchmark": "moe_decode",
        "threads": args.threads,
        "activations": args.activations,
        "cpu": describe(),
        "copy_bw_gb_s": [round(min(bws) / 1e9, 2), round(max(bws) / 1e9, 2)],
        "cases": [
            {
                "quantization": mode,
                "rows": rows,
                "step_ms": round(med(per[(mode, rows)]["step"]) * 1e3, 2),
                "bytes_read_mb": round(cases[(mode, rows)][1] / 1e6, 1),
                "step_over_floor": round(med(per[(mode, rows)]["floor"]), 3),
                "step_over_floor_range": [
                    round(min(per[(mode, rows)]["floor"]), 3),
                    round(max(per[(mode, rows)]["floor"]), 3),
                ],
                "loop_over_grouped": round(med(per[(mode, rows)]["loop"]), 3),
            }
            for mode, rows in cases
        ],
        "int4_over_float32": {
            str(r): round(med([a / b for a, b in zip(per[("int4", r)]["step"], per[("none", r)]["step"])]), 3)
            for r in rows_list
        },
        "goals": {"step_over_floor": "<= 1.3", "int4_over_float32": "<= 0.5"},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
