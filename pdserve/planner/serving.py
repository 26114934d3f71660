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

The steps subtracted are the served workers' own, read from their /metrics around each request
(pdserve_{decode,prefill}_step_seconds_total, engine.step() timed in the worker), where they can be
read; else the profile's. A VM's speed drifts between the profile and this calibration minutes
later, and a difference against the profile's steps took that drift for overhead: the per-request
overheads of four profiles of one day read +10 to +45 ms, and the per-step one was clamped at 0 in
two of them (the served TPOT below the profiled step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import Config
from pdserve.planner.step_costs import Serving, StepCosts

REPLY = 48
REPEATS = 5


def _serve(cmd_tail: list[str], tmp: Path, name: str):
    from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

    port = free_port()
    return ServerProcess(pdserve_cmd() + ["serve", "--port", str(port), *cmd_tail], port, tmp / f"{name}.log")


_STEP_KEYS = ("decode_steps", "decode_step_seconds", "prefill_steps", "prefill_step_seconds")


def step_counters(url: str) -> dict[str, float] | None:
    """A worker's served step counters (protocol/stats.py), None when its /metrics lacks them."""
    import httpx

    try:
        return parse_step_counters(httpx.get(url + "/metrics", timeout=10).text)
    except httpx.HTTPError:
        return None


def parse_step_counters(text: str) -> dict[str, float] | None:
    wanted = {f"pdserve_{k}_total": k for k in _STEP_KEYS}
    got = {
        wanted[s.name]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name in wanted
    }
    return got if len(got) == len(_STEP_KEYS) else None


def workers(url: str, mixed: bool) -> dict[str, str]:
    """role -> URL of the served workers whose steps are read: the server itself when mixed, else
    the router's registered workers (its admin API, open without keys); empty when unreadable."""
    if mixed:
        return {"decode": url, "prefill": url}
    import httpx

    try:
        r = httpx.get(url + "/admin/workers", timeout=10)
        listed = r.json().get("workers", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return {}
    return {w["role"]: w["url"] for w in listed if w.get("role") in ("prefill", "decode") and w.get("url")}


def _one(
    url: str, prompt_tokens: int, max_tokens: int, rng: random.Random, steps_of: dict[str, str] | None = None
) -> tuple[float, float | None, dict[str, dict[str, float]]]:
    """(TTFT, TPOT, per role the served step counters' increase over the request: empty where unread)."""
    from pdserve.bench.client import ClientConfig, run_load
    from pdserve.bench.workloads import Session, Turn, words

    urls = set((steps_of or {}).values())  # a mixed server is both roles: read it once
    before = {u: step_counters(u) for u in urls}
    cfg = ClientConfig(url, api="completions", ignore_eos=True)
    # sentences=False: n words of the list are n tokens for the default model's tokenizer
    recs, _ = asyncio.run(
        run_load(cfg, [Session(0, [Turn(words(rng, prompt_tokens, sentences=False), max_tokens)])])
    )
    r = recs[0]
    if not r.ok or r.ttft is None:
        raise RuntimeError(f"a calibration request failed: {r.error} {r.error_detail}")
    delta = {}
    for u in urls:
        b, a = before[u], step_counters(u)
        if b is not None and a is not None:
            delta[u] = {k: a[k] - b[k] for k in _STEP_KEYS}
    served = {role: delta[u] for role, u in (steps_of or {}).items() if u in delta}
    return r.ttft, r.tpot, served


def _measure(
    url: str, short: int, long: int | None, rng: random.Random, steps_of: dict[str, str] | None = None
) -> dict[str, float]:
    """Medians of TTFT and TPOT, and of the served steps they contain where the workers' counters
    were read: decode_step (a decode step of the TPOT request), short_prefill (the short prompt's
    prefill steps), long_prefill and long_decode_step (the long prompt's, on the prefill worker,
    and the decode step its first token joins)."""
    _one(url, short, 4, rng)  # warm up
    out: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            out.setdefault(key, []).append(value)

    def mean_decode(d: dict[str, float] | None) -> float | None:
        return d["decode_step_seconds"] / d["decode_steps"] if d and d["decode_steps"] > 0 else None

    for _ in range(REPEATS):
        _, tpot, served = _one(url, short, REPLY, rng, steps_of)
        add("tpot", tpot or 0.0)
        add("decode_step", mean_decode(served.get("decode")))
        ttft, _, served = _one(url, short, 2, rng, steps_of)
        add("short", ttft)
        d = served.get("decode")
        add("short_prefill", d["prefill_step_seconds"] if d and d["prefill_steps"] > 0 else None)
        if long:
            ttft, _, served = _one(url, long, 2, rng, steps_of)
            add("long", ttft)
            p = served.get("prefill")
            add("long_prefill", p["prefill_step_seconds"] if p and p["prefill_steps"] > 0 else None)
            add("long_decode_step", mean_decode(served.get("decode")))
    # Medians, like the profiled steps these are compared with.
    return {k: statistics.median(v) for k, v in out.items() if len(v) == REPEATS}


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
    floor = local_prefill_max_tokens + 16  # sent to a prefill worker
    return min((r for r in costs.prefill.rows if floor <= r <= prefill_chunk), default=max(256, floor))


def _profiled_decode_1(costs: StepCosts, short: int) -> float:
    """The profile's batch-1 decode step over the calibration reply's contexts."""
    return statistics.mean(costs.decode_s(1, short + i) for i in range(1, REPLY))


def overheads(
    costs: StepCosts, pd: dict[str, float], mixed: dict[str, float], short: int, long: int, prefill_chunk: int
) -> Serving:
    """The serving figures from the medians measured (tpot, short and long TTFT, in seconds), less
    the served steps where _measure read them (else the profile's)."""
    decode_1 = _profiled_decode_1(costs, short)
    pd_step = max(0.0, pd["tpot"] - pd.get("decode_step", decode_1))
    mixed_step = max(0.0, mixed["tpot"] - mixed.get("decode_step", decode_1))

    def local_steps(m: dict[str, float], step: float) -> float:
        if "short_prefill" in m:
            return m["short_prefill"] + step
        return _prefill_steps(costs, short, 1 << 30, step)

    # A remote first token goes out with the outputs of the decode step its request joins.
    if "long_prefill" in pd and "long_decode_step" in pd:
        remote_prefill = pd["long_prefill"] + pd_step * -(-long // prefill_chunk)
        joined = pd["long_decode_step"]
    else:
        remote_prefill, joined = _prefill_steps(costs, long, prefill_chunk, pd_step), costs.decode_s(1, long)
    remote_steps = remote_prefill + costs.exposed_transfer_s(long) + joined + pd_step
    return Serving(
        pd_local_overhead_s=max(0.0, pd["short"] - local_steps(pd, pd_step)),
        pd_remote_overhead_s=max(0.0, pd["long"] - remote_steps),
        pd_step_s=pd_step,
        mixed_overhead_s=max(0.0, mixed["short"] - local_steps(mixed, mixed_step)),
        mixed_step_s=mixed_step,
    )


def served_scales(
    costs: StepCosts, pd: dict[str, float], mixed: dict[str, float], short: int, long: int
) -> tuple[float, float, float, float]:
    """(decode, prefill, decode lent, prefill lent): the served workers' steps ÷ the profile's same
    steps, 1.0 where not read. The profile times its steps in its own process; the served workers'
    steps of the same shape have come out both faster and slower (three profiles of one day: a batch-1
    decode step 20% slower in the profile than served minutes later, and 4-7% faster), and the plan
    predicts served steps. Both scales are the mixed server's (its own threads; where unread, the PD
    workers'), and each `lent` the PD workers' steps ÷ that: a PD worker on one machine borrows its
    idle peer's cores, so its batch-1 decode step ran 0.5-0.7x the mixed server's on an Intel Xeon,
    and one scale between the two predicted PD TPOTs 11-26% long and mixed ones 30% short
    (benchmarks/plan_accuracy.py). Prefill steps borrow as well (the decode worker's local prompts,
    the prefill worker's): one prefill scale over both deployments put an AMD EPYC's mixed TTFTs
    22-33% short."""
    decode_1 = _profiled_decode_1(costs, short)
    pd_dec = pd["decode_step"] / decode_1 if "decode_step" in pd else None
    own = mixed["decode_step"] / decode_1 if "decode_step" in mixed else pd_dec
    pd_pre = [pd["short_prefill"] / costs.prefill_s(short, 0)] if "short_prefill" in pd else []
    if "long_prefill" in pd:
        pd_pre.append(pd["long_prefill"] / costs.prefill_s(long, 0))
    pd_prefill = statistics.geometric_mean(pd_pre) if pd_pre else None
    own_prefill = (
        mixed["short_prefill"] / costs.prefill_s(short, 0) if "short_prefill" in mixed else pd_prefill
    )
    lent = pd_dec / own if pd_dec is not None and own is not None else 1.0
    prefill_lent = pd_prefill / own_prefill if pd_prefill is not None and own_prefill is not None else 1.0
    return (own or 1.0, own_prefill or 1.0, lent, prefill_lent)


def measure_serving(
    config: Config, config_file: str, costs: StepCosts, prefill_chunk: int, log: Callable[[str], None] = print
) -> tuple[Serving, tuple[float, float]]:
    """The serving overheads (with served_scales' lent factors), and its (decode, prefill) for the
    profile's grids."""
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
    rng = random.Random(1)
    short = max(4, config.disagg.local_prefill_max_tokens // 2)
    long = remote_prompt_tokens(costs, config.disagg.local_prefill_max_tokens, prefill_chunk)
    base = ["--config", config_file]
    with _serve(base + ["--prefill", "1", "--decode", "1"], tmp, "pd") as srv:
        srv.wait_ready(timeout=600)
        pd = _measure(srv.url, short, long, rng, workers(srv.url, mixed=False))
    with _serve(base + ["--mode", "mixed", "--threads", str(costs.threads)], tmp, "mixed") as srv:
        srv.wait_ready(timeout=600)
        mixed = _measure(srv.url, short, None, rng, workers(srv.url, mixed=True))
    s = overheads(costs, pd, mixed, short, long, prefill_chunk)
    served = "served" if "decode_step" in pd and "decode_step" in mixed else "profiled"
    log(
        f"serving (less the {served} steps): PD TPOT {pd['tpot'] * 1000:.1f} ms (+{s.pd_step_s * 1000:.1f} ms a step), "
        f"TTFT {short} tokens {pd['short'] * 1000:.0f} ms (+{s.pd_local_overhead_s * 1000:.0f}), "
        f"{long} tokens {pd['long'] * 1000:.0f} ms "
        f"(+{s.pd_remote_overhead_s * 1000:.0f}); mixed TPOT {mixed['tpot'] * 1000:.1f} ms (+{s.mixed_step_s * 1000:.1f}), "
        f"TTFT {mixed['short'] * 1000:.0f} ms (+{s.mixed_overhead_s * 1000:.0f})"
    )
    dec, pre, lent, prefill_lent = served_scales(costs, pd, mixed, short, long)
    log(
        f"served steps ÷ profiled: decode x{dec:.2f}, prefill x{pre:.2f} (the grids are scaled by them); "
        f"a PD step borrowing idle cores: decode x{lent:.2f}, prefill x{prefill_lent:.2f}"
    )
    return dataclasses.replace(s, pd_decode_lent=lent, pd_prefill_lent=prefill_lent), (dec, pre)
