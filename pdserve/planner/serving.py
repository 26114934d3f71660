"""What serving adds to the engine's steps (StepCosts.serving), measured on idle real deployments.

`pdserve profile` starts `pdserve serve` twice with the profiled config, a 1P1D deployment and a
mixed server, and sends single requests one at a time through the bench client (completions API):
- a reply of 48 tokens: TPOT minus the profiled batch-1 decode step is the per-step overhead (the
  worker's event loop, streaming each token through the router);
- a short prompt (the decode worker prefills it) and a long one (a prefill worker does): TTFT minus
  the profiled steps that compute it is the per-request overhead (HTTP, the router, the PD
  handshake, the first token's way back). For the long prompt those steps are its prefill, the
  exposed transfer and the decode step its request joins on the decode worker (the first token goes
  out with that step's outputs, as the simulator has it); its length is a profiled prefill row, so
  the difference is not the grid's interpolation error (a 256-token prompt between rows 128 and 512
  was put 13% above its step, which left a remote overhead of 0).
The median of five repeats, as the profile's decode steps are medians (the overhead is a difference
of the two); run it on a quiet machine (the benchmark lock).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from pdserve.config import Config
from pdserve.router.step_costs import Serving, StepCosts

REPLY = 48
REPEATS = 5


def _serve(cmd_tail: list[str], tmp: Path, name: str):
    from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
    port = free_port()
    return ServerProcess(pdserve_cmd() + ["serve", "--port", str(port), *cmd_tail], port, tmp / f"{name}.log")


def _one(url: str, prompt_tokens: int, max_tokens: int, rng: random.Random) -> tuple[float, float | None]:
    from pdserve.bench.client import ClientConfig, run_load
    from pdserve.bench.workloads import Session, Turn, words
    cfg = ClientConfig(url, api="completions", ignore_eos=True)
    # sentences=False: n words of the list are n tokens for the default model's tokenizer
    recs, _ = asyncio.run(run_load(cfg, [Session(0, [Turn(words(rng, prompt_tokens, sentences=False), max_tokens)])]))
    r = recs[0]
    if not r.ok or r.ttft is None:
        raise RuntimeError(f"a calibration request failed: {r.error} {r.error_detail}")
    return r.ttft, r.tpot


def _measure(url: str, short: int, long: int | None, rng: random.Random) -> dict[str, float]:
    _one(url, short, 4, rng)                         # warm up
    out: dict[str, list[float]] = {"tpot": [], "short": [], "long": []}
    for _ in range(REPEATS):
        _, tpot = _one(url, short, REPLY, rng)
        out["tpot"].append(tpot or 0.0)
        out["short"].append(_one(url, short, 2, rng)[0])
        if long:
            out["long"].append(_one(url, long, 2, rng)[0])
    # Medians, like the profiled steps these are compared with.
    return {k: statistics.median(v) for k, v in out.items() if v}


def _prefill_steps(costs: StepCosts, tokens: int, chunk: int, step_s: float) -> float:
    t, done = 0.0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        t += costs.prefill_s(n, done) + step_s
        done += n
    return t


def remote_prompt_tokens(costs: StepCosts, local_prefill_max_tokens: int, prefill_chunk: int) -> int:
    """The calibration's long prompt: the shortest profiled prefill row a prefill worker computes in
    one step, so its steps are measured, not interpolated (256 when no row fits)."""
    floor = local_prefill_max_tokens + 16         # sent to a prefill worker
    return min((r for r in costs.prefill.rows if floor <= r <= prefill_chunk), default=max(256, floor))


def overheads(costs: StepCosts, pd: dict[str, float], mixed: dict[str, float], short: int, long: int,
              prefill_chunk: int) -> Serving:
    """The serving figures from the medians measured (tpot, short and long TTFT, in seconds)."""
    decode_1 = statistics.mean(costs.decode_s(1, short + i) for i in range(1, REPLY))
    pd_step = max(0.0, pd["tpot"] - decode_1)
    mixed_step = max(0.0, mixed["tpot"] - decode_1)
    # A remote first token goes out with the outputs of the decode step its request joins.
    remote_steps = (_prefill_steps(costs, long, prefill_chunk, pd_step) + costs.exposed_transfer_s(long)
                    + costs.decode_s(1, long) + pd_step)
    return Serving(pd_local_overhead_s=max(0.0, pd["short"] - _prefill_steps(costs, short, 1 << 30, pd_step)),
                   pd_remote_overhead_s=max(0.0, pd["long"] - remote_steps),
                   pd_step_s=pd_step,
                   mixed_overhead_s=max(0.0, mixed["short"] - _prefill_steps(costs, short, 1 << 30, mixed_step)),
                   mixed_step_s=mixed_step)


def measure_serving(config: Config, config_file: str, costs: StepCosts, prefill_chunk: int,
                    log: Callable[[str], None] = print) -> Serving:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
    rng = random.Random(1)
    short = max(4, config.disagg.local_prefill_max_tokens // 2)
    long = remote_prompt_tokens(costs, config.disagg.local_prefill_max_tokens, prefill_chunk)
    base = ["--config", config_file]
    with _serve(base + ["--prefill", "1", "--decode", "1"], tmp, "pd") as srv:
        srv.wait_ready(timeout=600)
        pd = _measure(srv.url, short, long, rng)
    with _serve(base + ["--mode", "mixed", "--threads", str(costs.threads)], tmp, "mixed") as srv:
        srv.wait_ready(timeout=600)
        mixed = _measure(srv.url, short, None, rng)
    s = overheads(costs, pd, mixed, short, long, prefill_chunk)
    log(f"serving: PD TPOT {pd['tpot'] * 1000:.1f} ms (+{s.pd_step_s * 1000:.1f} ms a step), TTFT {short} tokens "
        f"{pd['short'] * 1000:.0f} ms (+{s.pd_local_overhead_s * 1000:.0f}), {long} tokens {pd['long'] * 1000:.0f} ms "
        f"(+{s.pd_remote_overhead_s * 1000:.0f}); mixed TPOT {mixed['tpot'] * 1000:.1f} ms (+{s.mixed_step_s * 1000:.1f}), "
        f"TTFT {mixed['short'] * 1000:.0f} ms (+{s.mixed_overhead_s * 1000:.0f})")
    return s
