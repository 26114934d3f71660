"""`pdserve serve|bench ...`: the command line."""
from __future__ import annotations

import argparse
import logging
import os
import sys

# Set before torch loads OpenMP: on a 2-core machine shared with a router and other workers,
# spinning OpenMP threads collapse throughput (a 10x slowdown was measured under load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (see examples/)")
    p.add_argument("--model", help="smollm2-135m (default), tiny-llama, a .gguf file or a HF directory")
    p.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--device-memory-gb", type=float, help="KV cache budget")
    p.add_argument("--device-blocks", type=int, help="KV blocks (overrides --device-memory-gb)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                   help="turn off reuse of cached prompt prefixes")
    p.add_argument("--max-num-seqs", type=int, help="cap on running requests (the decode batch cap)")
    p.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget")
    p.add_argument("--threads", type=int, help="torch compute threads")
    p.add_argument("--seed", type=int, help="seed of tiny random model weights")


def _overrides(args: argparse.Namespace) -> dict:
    return {
        "model.name": args.model, "model.dtype": args.dtype, "model.device": args.device,
        "model.max_model_len": args.max_model_len, "model.seed": args.seed,
        "cache.block_size": args.block_size, "cache.device_memory_gb": args.device_memory_gb,
        "cache.device_blocks": args.device_blocks, "cache.prefix_cache": args.prefix_cache,
        "scheduler.max_num_seqs": args.max_num_seqs,
        "scheduler.max_num_batched_tokens": args.max_num_batched_tokens, "server.threads": args.threads,
        "server.served_model_name": args.served_model_name,
        "server.host": getattr(args, "host", None), "server.port": getattr(args, "port", None),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from pdserve.bench.cli import main as bench_main
        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with PD disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a deployment serving the OpenAI API")
    serve.add_argument("--mode", choices=["mixed"], default="mixed",
                       help="mixed: one process prefills and decodes")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    _add_engine_flags(serve)
    sub.add_parser("bench", help="load generator and report (pdserve bench --help)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from pdserve.config import load_config

    config = load_config(args.config, _overrides(args))
    if args.command == "serve":
        from pdserve.server.app import serve as run_server
        run_server(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
