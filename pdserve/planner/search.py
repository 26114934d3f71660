"""`pdserve plan`: the P:D split and per-role settings that maximise goodput under the SLOs, found by
running the PD simulator (planner/pd_simulate.py) on a machine's measured step costs.

Workloads are the benchmark's own (pdserve/bench/workloads.py) with the bench client's Poisson
arrivals (bench/client.poisson_arrivals, same seed), so a plan and `pdserve bench` see the same
trace. Prompt lengths are counted from the text as the default model's tokenizer splits it: each
word of the workload's word list is one token and a full stop another (see workloads.py); the
completions API is assumed (no chat template). Multi-turn sessions: every turn arrives with its
session and carries the history as prompt, replies counted at max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.bench.client import poisson_arrivals
from pdserve.bench.metrics import percentile
from pdserve.bench.workloads import make_workload
from pdserve.planner.pd_simulate import PDFleet, PDRequest, RoleSettings, simulate_pd
from pdserve.planner.step_costs import StepCosts


def text_tokens(text: str) -> int:
    return len(text.split()) + text.count(".")


def workload_requests(
    name: str, n: int, rate: float, seed: int = 0, max_tokens: int | None = None, input_len: int = 128
) -> list[PDRequest]:
    """The workload's requests (ignore_eos: each generates its max_tokens) at Poisson arrivals."""
    sessions = make_workload(name, n, seed=seed, max_tokens=max_tokens, input_len=input_len)
    arrivals = poisson_arrivals(len(sessions), rate, seed)
    out: list[PDRequest] = []
    for s, at in zip(sessions, arrivals):
        history = text_tokens(s.system) if s.system else 0
        history += sum(text_tokens(str(m.get("content", ""))) for m in s.preset or [])
        for turn in s.turns:
            prompt = history + text_tokens(turn.text)
            out.append(PDRequest(len(out), at, max(1, prompt), turn.max_tokens, turn.max_tokens))
            history = prompt + turn.max_tokens
    return out


@dataclass(frozen=True)
class Prediction:
    fleet: PDFleet
    goodput_req_s: float
    attained: float  # share of requests within both SLOs
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    duration_s: float

    def row(self) -> dict:
        f = self.fleet
        return {
            "deployment": f.describe(),
            "workers": f.mixed or f.prefill + f.decode,
            "prefill_max_num_batched_tokens": None if f.mixed else f.prefill_settings.max_num_batched_tokens,
            "decode_max_num_seqs": f.decode_settings.max_num_seqs,
            "decode_max_num_batched_tokens": f.decode_settings.max_num_batched_tokens,
            "goodput_req_s": round(self.goodput_req_s, 3),
            "attained": round(self.attained, 3),
            "ttft_ms": {"p50": round(self.ttft_p50_s * 1000, 1), "p90": round(self.ttft_p90_s * 1000, 1)},
            "tpot_ms": {"p50": round(self.tpot_p50_s * 1000, 1), "p90": round(self.tpot_p90_s * 1000, 1)},
        }


def served(fleet: PDFleet, costs: StepCosts) -> PDFleet:
    """The fleet with the profile's measured serving overheads (none when the profile has none)."""
    s = costs.serving
    if s is None:
        return fleet
    if fleet.mixed:
        return replace(
            fleet,
            overhead_s=s.mixed_overhead_s,
            remote_overhead_s=s.mixed_overhead_s,
            step_overhead_s=s.mixed_step_s,
        )
    return replace(
        fleet,
        overhead_s=s.pd_local_overhead_s,
        remote_overhead_s=s.pd_remote_overhead_s,
        step_overhead_s=s.pd_step_s,
        decode_lent=s.pd_decode_lent,
        prefill_lent=s.pd_prefill_lent,
    )


def predict(
    costs: StepCosts,
    fleet: PDFleet,
    requests: list[PDRequest],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> Prediction:
    """`fleet` simulated on `costs` with their serving overheads (served)."""
    done = simulate_pd(requests, served(fleet, costs), costs)
    ttft = [r.ttft for r in done]
    tpot = [t for r in done if (t := r.tpot) is not None]
    good = sum(
        1
        for r in done
        if (slo_ttft_s is None or r.ttft <= slo_ttft_s)
        and (slo_tpot_s is None or r.tpot is None or r.tpot <= slo_tpot_s)
    )
    # Like the bench client: the run lasts from the first arrival to the last reply.
    duration = max(r.finish for r in done) - min(r.arrival for r in done)
    return Prediction(
        fleet,
        good / duration if duration > 0 else 0.0,
        good / len(done),
        percentile(ttft, 50),
        percentile(ttft, 90),
        percentile(tpot, 50) if tpot else 0.0,
        percentile(tpot, 90) if tpot else 0.0,
        duration,
    )


@dataclass(frozen=True)
class SearchSpace:
    max_workers: int
    prefill_chunks: tuple[int, ...] = (128, 256, 512, 1024)
    decode_max_num_seqs: tuple[int, ...] = (8, 16, 32, 64)
    mixed: bool = True  # also consider a mixed deployment (one process, no disaggregation)


def candidates(base: PDFleet, space: SearchSpace) -> list[PDFleet]:
    out = []
    for seqs in space.decode_max_num_seqs:
        dec = replace(base.decode_settings, max_num_seqs=seqs)
        for n in range(2, space.max_workers + 1):
            for p in range(1, n):
                for chunk in space.prefill_chunks:
                    out.append(
                        replace(
                            base,
                            prefill=p,
                            decode=n - p,
                            mixed=0,
                            decode_settings=dec,
                            prefill_settings=replace(base.prefill_settings, max_num_batched_tokens=chunk),
                        )
                    )
        if space.mixed:
            # One process: what `pdserve serve --mode mixed` runs (mixed workers behind a router are not planned).
            out.append(replace(base, prefill=0, decode=0, mixed=1, decode_settings=dec))
    return out


@dataclass(frozen=True)
class Plan:
    best: Prediction
    feasible: bool  # best.attained >= the attainment asked for
    ranked: list[Prediction]


def plan(
    costs: StepCosts,
    base: PDFleet,
    requests: list[PDRequest],
    slo_ttft_s: float,
    slo_tpot_s: float,
    space: SearchSpace,
    attainment: float = 0.9,
) -> Plan:
    """Every candidate simulated; ranked by goodput, then fewer workers, then TTFT p90."""
    preds = [predict(costs, f, requests, slo_ttft_s, slo_tpot_s) for f in candidates(base, space)]

    def workers(p: Prediction) -> int:
        return p.fleet.mixed or p.fleet.prefill + p.fleet.decode

    # Goodput within 1% counts as equal: a plan should not buy 0.5% with another worker.
    top = max(p.goodput_req_s for p in preds)
    ranked = sorted(
        preds,
        key=lambda p: (
            p.goodput_req_s < 0.99 * top,
            workers(p) if p.goodput_req_s >= 0.99 * top else -p.goodput_req_s,
            p.ttft_p90_s,
            p.tpot_p50_s,
        ),
    )
    best = ranked[0]
    return Plan(best, best.attained >= attainment, ranked)


def role_settings(max_num_seqs: int, max_num_batched_tokens: int) -> RoleSettings:
    return RoleSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
