"""The text `pdserve plan` prints: the chosen deployment, its predicted latencies and the config to run it."""

from __future__ import annotations

import argparse

import yaml

from pdserve.planner.search import Plan, Prediction
from pdserve.planner.step_costs import StepCosts


def config_snippet(p: Prediction) -> dict:
    """The deployment section that runs the plan (pdserve serve --config)."""
    f = p.fleet
    if f.mixed:
        return {
            "deployment": {"mode": "mixed"},
            "scheduler": {
                "max_num_seqs": f.decode_settings.max_num_seqs,
                "max_num_batched_tokens": f.decode_settings.max_num_batched_tokens,
            },
        }
    return {
        "deployment": {
            "mode": "pd",
            "prefill": {
                "instances": f.prefill,
                "max_num_batched_tokens": f.prefill_settings.max_num_batched_tokens,
            },
            "decode": {
                "instances": f.decode,
                "max_num_seqs": f.decode_settings.max_num_seqs,
                "max_num_batched_tokens": f.decode_settings.max_num_batched_tokens,
            },
        }
    }


def _line(p: Prediction) -> str:
    r = p.row()
    settings = (
        f"decode max_num_seqs {r['decode_max_num_seqs']}"
        if p.fleet.mixed
        else f"prefill chunk {r['prefill_max_num_batched_tokens']}, decode max_num_seqs {r['decode_max_num_seqs']}"
    )
    return (
        f"{r['deployment']:>7} ({settings}): goodput {r['goodput_req_s']:.2f} req/s, "
        f"{r['attained'] * 100:.0f}% within SLOs, TTFT p50 {r['ttft_ms']['p50']:.0f} ms p90 "
        f"{r['ttft_ms']['p90']:.0f} ms, TPOT p50 {r['tpot_ms']['p50']:.1f} ms"
    )


def format_plan(result: Plan, args: argparse.Namespace, costs: StepCosts, num_requests: int) -> str:
    b = result.best
    f = b.fleet
    lines = [
        f"pdserve plan: {args.workload} at {args.rate:g} req/s ({num_requests} requests), SLOs TTFT "
        f"{args.slo_ttft_ms:g} ms and TPOT {args.slo_tpot_ms:g} ms, at most {args.max_workers} workers",
        f"profile: {costs.model} ({costs.dtype}, quantization {costs.quantization}, {costs.threads} threads a "
        f"worker) on {costs.cpu}, {costs.cores} cores",
    ]
    if not result.feasible:
        lines.append(
            f"INFEASIBLE: no deployment of at most {args.max_workers} workers meets both SLOs for "
            f"{args.attainment * 100:.0f}% of requests; the best reaches {b.attained * 100:.0f}%"
        )
    what = f"{f.mixed} mixed worker(s)" if f.mixed else f"{f.prefill} prefill : {f.decode} decode"
    lines += [
        f"best: {what}",
        "  " + _line(b),
        f"  predicted TTFT p50 {b.ttft_p50_s * 1000:.0f} ms, p90 {b.ttft_p90_s * 1000:.0f} ms; "
        f"TPOT p50 {b.tpot_p50_s * 1000:.1f} ms",
        "config:",
        *("  " + s for s in yaml.safe_dump(config_snippet(b), sort_keys=False).splitlines()),
        "next best:",
    ]
    lines += ["  " + _line(p) for p in result.ranked[1:6]]
    return "\n".join(lines)
