"""`pdserve serve|bench ...`: the command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Set before torch loads OpenMP: on a 2-core machine shared with a router and other workers,
# spinning OpenMP threads collapse throughput (a 10x slowdown was measured under load). Whoever
# sets a spin count (GOMP_SPINCOUNT) or a policy of their own keeps it; see docs/deploying.md.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from pdserve.config_flags import add_flags, flag_overrides  # noqa: E402 - after the OpenMP setting
from pdserve.config_rules import ENGINES, MODES, WORKER_ROLES  # noqa: E402


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (see examples/)")
    add_flags(p)


def _overrides(args: argparse.Namespace) -> dict:
    return {
        **flag_overrides(args),
        "deployment.mode": getattr(args, "mode", None),
        "deployment.prefill.instances": getattr(args, "prefill", None),
        "deployment.decode.instances": getattr(args, "decode", None),
        "worker.role": getattr(args, "role", None),
        "worker.kv_port": getattr(args, "kv_port", None),
        "server.router_url": getattr(args, "router_url", None),
        "disagg.prefill_endpoints": (
            args.prefill_endpoints.split(",") if getattr(args, "prefill_endpoints", None) else None
        ),
    }


def build_parser() -> argparse.ArgumentParser:
    """The `pdserve` command line (`bench` has its own, see bench/cli.py)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with PD disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a deployment serving the OpenAI API")
    serve.add_argument(
        "--mode",
        choices=MODES,
        help="pd (default): a router, prefill and decode workers; mixed: one process does both",
    )
    serve.add_argument("--prefill", type=int, help="prefill workers (overrides the config file)")
    serve.add_argument("--decode", type=int, help="decode workers (overrides the config file)")
    serve.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config against the model (read without its weights), print the deployment "
        "plan and exit: 0 if it is good, 2 naming each bad key",
    )
    _add_engine_flags(serve)
    router = sub.add_parser("router", help="the router alone, for workers started elsewhere")
    router.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="a static worker, e.g. decode=http://10.0.0.2:8001 (repeatable); workers can "
        "also register themselves with --router-url. Another engine's worker, which the router fronts: "
        "vllm=http://10.0.0.3:8000,events=tcp://10.0.0.3:5557,replay=tcp://10.0.0.3:5558 (or sglang=...)",
    )
    _add_engine_flags(router)
    worker = sub.add_parser("worker", help="one worker process (pdserve serve starts these)")
    worker.add_argument("--role", choices=WORKER_ROLES, required=True)
    worker.add_argument("--kv-port", type=int, help="prefill: bootstrap port; decode: KV/control port")
    worker.add_argument(
        "--prefill-endpoints", help="decode: comma-separated bootstrap endpoints of prefill workers"
    )
    worker.add_argument("--router-url", help="register with this router and send it heartbeats")
    worker.add_argument("--port-file", help="write the bound HTTP port here once listening (with --port 0)")
    _add_engine_flags(worker)
    ep_rank = sub.add_parser(
        "ep-rank",
        help="an expert-parallel rank on another host than rank 0's worker (model.ep_rendezvous)",
    )
    which = ep_rank.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, help="this rank: model.ep_local_ranks or above")
    which.add_argument(
        "--pod-index",
        type=int,
        help="this host's place among the worker's hosts (1, 2, ...): it runs ranks pod-index x "
        "model.ep_local_ranks onwards, model.ep_local_ranks of them, one process each",
    )
    ep_rank.add_argument(
        "--role", choices=WORKER_ROLES, help="the worker's role, for its deployment.<role> settings"
    )
    _add_engine_flags(ep_rank)
    encoder = sub.add_parser(
        "encoder",
        help="an encoder worker: a vision-language model's vision tower, for the "
        "engines that name it in vision.encoder_endpoints",
    )
    encoder.add_argument("--bind", required=True, help="ZMQ endpoint to answer on, e.g. tcp://0.0.0.0:5600")
    _add_engine_flags(encoder)
    sub.add_parser("bench", help="load generator and report (pdserve bench --help)")
    sub.add_parser(
        "profile", help="measure this machine's step costs for the configured model (pdserve profile --help)"
    )
    sub.add_parser(
        "plan",
        help="the P:D split and per-role settings that maximise goodput under SLOs, from a profile "
        "(pdserve plan --help)",
    )
    sub.add_parser(
        "agent",
        help="start and stop this host's workers for a router's fleet (controller.backend: hosts; "
        "pdserve agent --help)",
    )
    sub.add_parser(
        "rollout",
        help="replace a running deployment's workers with a new config, canary first, rolled "
        "back on an SLO breach (pdserve rollout --help)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from pdserve.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] in (["profile"], ["plan"]):
        from pdserve.planner.cli import main as planner_main

        return planner_main(argv)
    if argv[:1] == ["agent"]:
        from pdserve.control.host_agent import main as agent_main

        return agent_main(argv[1:])
    if argv[:1] == ["rollout"]:
        from pdserve.control.rollout import main as rollout_main

        return rollout_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from pdserve.config import ConfigError, derive, load_config
    from pdserve.version import config_digest

    overrides = _overrides(args)
    try:
        digest = None
        if args.command in ("worker", "ep-rank"):
            from pdserve.deployment_plan import load_worker_config

            config, deployment = load_worker_config(args.config, overrides, args.role)
            # A worker's version names the deployment config it came from, before its role's settings.
            digest = config_digest(deployment) if args.command == "worker" else None
        else:
            config = load_config(args.config, overrides)
        if args.command == "serve":
            from pdserve.deployment_plan import format_plan, make_plan

            plan = make_plan(config)  # the model's architecture against the deployment
        if args.command == "router" or (args.command == "serve" and config.deployment.mode == "pd"):
            from pdserve.router.access import check_admin_exposure

            check_admin_exposure(config)  # before any worker starts
        if args.command == "worker":
            from pdserve.server.internal_api import check_worker_keys

            check_worker_keys(config)
    except ConfigError as e:
        flags = {k for k, v in overrides.items() if v is not None}
        for key, problem in e.problems:
            where = " (a command-line flag)" if key in flags else ""
            print(f"pdserve: config error: {key}{where}: {problem}", file=sys.stderr)
        return 2
    if args.command == "serve" and args.dry_run:
        print(
            f"pdserve serve --dry-run: {args.config or 'defaults'} is valid; nothing was started\n"
            + format_plan(plan)
        )
        return 0
    if args.command == "ep-rank":  # no HTTP port: steps come from rank 0
        from pdserve.model.ep_remote import check_rank, host_ranks, run_rank, run_ranks

        ranks = [args.rank] if args.rank is not None else host_ranks(config, args.pod_index)
        for rank in ranks:
            if problem := check_rank(config, rank):
                print(f"pdserve: config error: {problem}", file=sys.stderr)
                return 2
        if args.rank is not None:
            return run_rank(config, args.rank)
        return run_ranks(argv, ranks)
    if args.command == "encoder":  # no HTTP port: jobs come over ZeroMQ
        from pdserve.engine.encoder_worker import EncoderWorker

        EncoderWorker(config).serve(args.bind)
        return 0
    if args.command == "serve":
        for warning in plan.warnings:
            logging.getLogger("pdserve").warning("%s", warning)
    from pdserve.server.serving import bind_socket

    # Bind first: the port is ours before the seconds of model loading (see bind_socket).
    sock = bind_socket(config.server.host, config.server.port)
    config = derive(config, {"server.port": sock.getsockname()[1]})
    if args.command == "serve" and config.deployment.mode == "pd":
        from pdserve.launch import serve_pd

        serve_pd(config, sock)
    elif args.command == "serve":
        config = derive(config, {"worker.role": "mixed"})
        from pdserve.server.app import serve as run_server

        run_server(config, sock)
    elif args.command == "router":
        workers = list(config.router.workers)
        for spec in args.worker:
            role, _, rest = spec.partition("=")
            url, *extra = rest.split(",")
            entry = {"role": role, "url": url}
            # vllm=URL,events=tcp://...,replay=tcp://...: another engine's KV event sockets
            names = {"events": "kv_events_endpoint", "replay": "kv_events_replay_endpoint"}
            for item in extra:
                k, _, v = item.partition("=")
                if k not in names or not v or role not in ENGINES:
                    parser.error(
                        f"--worker: {item!r} is not events=tcp://... or replay=tcp://... of a vllm|sglang worker"
                    )
                entry[names[k]] = v
            if not url or role not in (*WORKER_ROLES, *ENGINES):
                parser.error(
                    f"--worker wants ROLE=URL with ROLE prefill|decode|mixed (pdserve) or vllm|sglang, not {spec!r}"
                )
            workers.append(entry)
        from pdserve.config_rules import FORMATS

        if problem := FORMATS["router.workers"](workers):
            parser.error(f"--worker: {problem}")
        config = derive(config, {"router.workers": workers})
        from pdserve.router.gateway import create_router_app
        from pdserve.server.serving import run_uvicorn

        run_uvicorn(create_router_app(config), config, tls=True, sock=sock)
    elif args.command == "worker":
        if args.port_file:
            tmp = args.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(config.server.port))
            os.replace(tmp, args.port_file)
        from pdserve.server.app import serve as run_server

        run_server(config, sock, digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
