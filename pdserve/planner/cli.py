"""`pdserve profile` and `pdserve plan`: the command lines of the planner."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.config_flags import add_flags, flag_overrides

DEFAULT_PROFILE = "pdserve-profile.json"


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {v}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {s}")
    return v


def _ints(s: str) -> tuple[int, ...]:
    return tuple(_positive_int(x) for x in s.split(","))


def profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve profile",
        description=(
            "Measure this machine's engine step costs for the configured model (prefill per chunk and "
            "context, decode per batch size and context, KV transfer per byte) and write them to a file "
            "for `pdserve plan`."
        ),
    )
    p.add_argument(
        "--config", help="YAML config file: its model, quantization, threads and transport are profiled"
    )
    p.add_argument(
        "--role",
        choices=("decode", "prefill"),
        default="decode",
        help="whose settings (deployment.<role>: threads, quantization) to profile (default decode)",
    )
    p.add_argument(
        "--output",
        "-o",
        default=DEFAULT_PROFILE,
        help=f"where to write the profile (default {DEFAULT_PROFILE})",
    )
    p.add_argument("--quick", action="store_true", help="a small grid (seconds; for tests and smoke checks)")
    p.add_argument(
        "--no-serving",
        action="store_true",
        help="skip timing idle served requests (a 1P1D deployment and a mixed server started for ~1 minute) "
        "for the per-request and per-step overheads of serving; the plan then counts the steps alone",
    )
    p.add_argument("--prefill-chunks", type=_ints, help="chunk sizes to time, comma-separated")
    p.add_argument("--prefill-contexts", type=_ints, help="contexts to report prefill at, comma-separated")
    p.add_argument("--decode-batches", type=_ints, help="decode batch sizes to time")
    p.add_argument("--decode-contexts", type=_ints, help="contexts to time decode at")
    add_flags(p)
    return p


def plan_parser() -> argparse.ArgumentParser:
    from pdserve.bench.workloads import SYNTHETIC

    p = argparse.ArgumentParser(
        prog="pdserve plan",
        description=(
            "Simulate every P:D split (and mixed deployment) of at most --max-workers workers and per-role "
            "settings on a profile's costs; print the one that maximises goodput under the SLOs."
        ),
    )
    p.add_argument(
        "--workload",
        required=True,
        help=f"a benchmark workload ({', '.join(SYNTHETIC)}) or a .jsonl file (pdserve bench's format)",
    )
    p.add_argument(
        "--rate", type=_positive_float, required=True, help="requests per second (Poisson arrivals)"
    )
    p.add_argument("--slo-ttft-ms", type=_positive_float, required=True)
    p.add_argument("--slo-tpot-ms", type=_positive_float, required=True)
    p.add_argument("--max-workers", type=_positive_int, required=True, help="workers (processes) at most")
    p.add_argument(
        "--profile", default=DEFAULT_PROFILE, help=f"from pdserve profile (default {DEFAULT_PROFILE})"
    )
    p.add_argument(
        "--config", help="YAML config file: routing policies, local_prefill_max_tokens, scheduler limits"
    )
    p.add_argument("--num-requests", type=_positive_int, default=200)
    p.add_argument(
        "--max-tokens", type=_positive_int, help="every reply this long (default: the workload's own)"
    )
    p.add_argument("--input-len", type=_positive_int, default=128, help="prompt words of the fixed workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attainment",
        type=_positive_float,
        default=0.9,
        help="share of requests that must meet both SLOs for a plan to count as feasible (default 0.9)",
    )
    p.add_argument(
        "--prefill-chunks",
        type=_ints,
        default=(128, 256, 512, 1024),
        help="prefill max_num_batched_tokens values to try",
    )
    p.add_argument(
        "--decode-max-num-seqs", type=_ints, default=(8, 16, 32, 64), help="decode max_num_seqs values to try"
    )
    p.add_argument("--no-mixed", action="store_true", help="consider only disaggregated deployments")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def run_profile(argv: list[str]) -> int:
    from dataclasses import replace

    from pdserve.config import ConfigError, load_config
    from pdserve.planner.profile import QUICK, ProfileGrid, profile

    args = profile_parser().parse_args(argv)
    try:
        config = load_config(args.config, flag_overrides(args))
    except ConfigError as e:
        for key, problem in e.problems:
            print(f"pdserve profile: config error: {key}: {problem}", file=sys.stderr)
        return 2
    grid = QUICK if args.quick else ProfileGrid()
    picked = {
        k: tuple(sorted(set(v)))
        for k in ("prefill_chunks", "prefill_contexts", "decode_batches", "decode_contexts")
        if (v := getattr(args, k))
    }
    grid = replace(grid, **picked)  # type: ignore[arg-type]
    try:
        costs = profile(config, args.role, grid, log=lambda s: print(s, file=sys.stderr))
    except ValueError as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    if not args.no_serving:
        from pdserve.config import for_role
        from pdserve.planner.serving import measure_serving

        chunk = for_role(config, "prefill").scheduler.max_num_batched_tokens
        try:
            serving, (dec, pre) = measure_serving(
                config, _served_config(args), costs, chunk, log=lambda s: print(s, file=sys.stderr)
            )
        except RuntimeError as e:
            print(f"pdserve profile: timing served requests failed: {e}", file=sys.stderr)
            return 1
        # The plan predicts served steps: the grids as the served workers ran them (served_scales).
        costs = replace(
            costs,
            serving=serving,
            decode=costs.decode.scaled(dec),
            prefill=costs.prefill.scaled(pre),
            notes={
                **costs.notes,
                "served_scale": {
                    "decode": round(dec, 4),
                    "prefill": round(pre, 4),
                    "pd_decode_lent": round(serving.pd_decode_lent, 4),
                    "pd_prefill_lent": round(serving.pd_prefill_lent, 4),
                },
            },
        )
    costs.save(args.output)
    print(
        f"pdserve profile: wrote {args.output} ({costs.cpu}; {costs.model}, {costs.threads} threads, "
        f"quantization {costs.quantization})"
    )
    return 0


def _served_config(args: argparse.Namespace) -> str:
    """A YAML file of the config file with the command line's flags on top, for the served deployments."""
    import tempfile

    import yaml

    from pdserve.config_yaml import nest_dotted

    data = nest_dotted(
        flag_overrides(args), (yaml.safe_load(open(args.config).read()) or {}) if args.config else {}
    )
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pdserve-profile-", delete=False)
    with f:
        yaml.safe_dump(data, f)
    return f.name


def run_plan(argv: list[str]) -> int:
    from pdserve.config import ConfigError, load_config
    from pdserve.planner.pd_simulate import PDFleet, RoleSettings
    from pdserve.planner.report import format_plan
    from pdserve.planner.search import SearchSpace, plan, workload_requests
    from pdserve.planner.step_costs import ProfileError, StepCosts

    parser = plan_parser()
    args = parser.parse_args(argv)
    try:
        costs = StepCosts.load(args.profile)
    except ProfileError as e:
        print(f"pdserve plan: {e} (run `pdserve profile` first)", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as e:
        for key, problem in e.problems:
            print(f"pdserve plan: config error: {key}: {problem}", file=sys.stderr)
        return 2
    try:
        requests = workload_requests(
            args.workload, args.num_requests, args.rate, args.seed, args.max_tokens, args.input_len
        )
    except (ValueError, OSError) as e:
        print(f"pdserve plan: --workload: {e}", file=sys.stderr)
        return 2
    sc = config.scheduler
    base = PDFleet(
        prefill_settings=RoleSettings(sc.max_num_seqs, sc.max_num_batched_tokens),
        decode_settings=RoleSettings(sc.max_num_seqs, sc.max_num_batched_tokens),
        local_prefill_max_tokens=config.disagg.local_prefill_max_tokens,
        prefill_policy=config.load_balancer.prefill,
        decode_policy=config.load_balancer.decode,
        block_size=costs.block_size,
        threads=costs.threads,
        cores=costs.cores,
    )
    space = SearchSpace(args.max_workers, args.prefill_chunks, args.decode_max_num_seqs, not args.no_mixed)
    result = plan(
        costs, base, requests, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000, space, args.attainment
    )
    if args.json:
        print(
            json.dumps(
                {
                    "feasible": result.feasible,
                    "best": result.best.row(),
                    "ranked": [p.row() for p in result.ranked[:10]],
                    "cpu": costs.cpu,
                    "model": costs.model,
                }
            )
        )
    else:
        print(format_plan(result, args, costs, len(requests)))
    return 0 if result.feasible else 1


def main(argv: list[str]) -> int:
    """argv starts with the command: profile or plan."""
    return run_profile(argv[1:]) if argv[0] == "profile" else run_plan(argv[1:])
