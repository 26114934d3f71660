"""An event-driven simulator of a PD fleet in seconds, for the planner (`pdserve plan`).

Where planner/simulate.py compares routing policies in abstract steps, this one predicts latencies:
each worker runs engine steps whose durations come from a machine's measured costs
(planner/step_costs.py), with the engine's own scheduling rules and the router's own policies
(router/policies.py, through the same RouteRequest/WorkerState figures the gateway keeps, see
router/accounting.py):

- the router picks a decode worker, then a prefill worker, for every request on arrival; the
  decode worker prefills a prompt itself when it is shorter than local_prefill_max_tokens;
- a decode (or mixed) worker takes in new requests at its step boundaries, up to max_num_seqs
  (loading ones count); each step serves running requests first (a token each, or a chunk of a
  local prompt) out of max_num_batched_tokens, then admits waiting ones;
- a prefill worker runs its jobs' prompts in chunks of max_num_batched_tokens; the first token is
  sampled there, and the decode worker takes the request in when the KV has arrived (the exposed
  part of the transfer, after the last chunk) at its next step boundary, decodes its second token
  in that step and shows both at the step's end (the engine returns a step's outputs, the loaded
  request's first token among them, after running the step: LLMEngine.step);
- the workers share the machine: a step that starts while another worker computes runs slower by
  the profile's measured factor (memory bandwidth), and proportionally slower again while more
  compute threads are busy than there are cores.

Not modelled: prefix caching, preemption (KV is assumed to fit) and the network between hosts.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from pdserve.planner.step_costs import StepCosts
from pdserve.router.policies import RouteRequest, WorkerState, choose


@dataclass
class PDRequest:
    rid: int
    arrival: float  # seconds from the start
    prompt_tokens: int
    output_tokens: int  # what it generates (the router knows only max_tokens)
    max_tokens: int = 0  # 0: output_tokens
    # filled in while it runs
    first_token: float = -1.0
    finish: float = -1.0
    generated: int = 0
    computed: int = 0  # prompt tokens prefilled so far
    remote: bool = False

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """(finish - first token) / (tokens - 1), as the bench client measures it."""
        return (self.finish - self.first_token) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class RoleSettings:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


@dataclass(frozen=True)
class PDFleet:
    prefill: int = 1
    decode: int = 1
    mixed: int = 0  # > 0: a mixed deployment (no prefill or decode pool)
    prefill_settings: RoleSettings = RoleSettings()
    decode_settings: RoleSettings = RoleSettings()  # also a mixed worker's
    local_prefill_max_tokens: int = 64
    prefill_policy: str = "cost"
    decode_policy: str = "cost"
    block_size: int = 16
    threads: int = 1  # compute threads of each worker
    cores: int | None = None  # None: every worker has cores of its own
    overhead_s: float = 0.0  # fixed per request (HTTP, router, streaming), added to TTFT
    remote_overhead_s: float = 0.0  # the same for a prompt a prefill worker computes (the PD handshake too)
    step_overhead_s: float = 0.0  # added to every step (a served step beyond the engine's own)
    # A decode step's time × this where every other worker is idle on the shared machine (cores set):
    # it borrows their cores (Serving.pd_decode_lent).
    decode_lent: float = 1.0
    prefill_lent: float = 1.0  # the same for a step with prompt tokens (Serving.pd_prefill_lent)

    def describe(self) -> str:
        if self.mixed:
            return f"{self.mixed} mixed"
        return f"{self.prefill}P{self.decode}D"


@dataclass
class _Worker:
    wid: str
    role: str
    settings: RoleSettings
    waiting: deque[PDRequest] = field(default_factory=deque)
    running: list[PDRequest] = field(default_factory=list)
    loading: int = 0
    arrived: list[PDRequest] = field(default_factory=list)  # KV in, taken in at the next boundary
    shown: list[PDRequest] = field(default_factory=list)  # taken in: first token shown at this step's end
    busy_until: float = -1.0
    step: list[tuple[PDRequest, int]] = field(default_factory=list)
    # the router's figures (accounting.Charge)
    in_flight: int = 0
    queued: int = 0
    decode_tokens: int = 0

    def state(self) -> WorkerState:
        return WorkerState(
            self.wid,
            self.role,
            in_flight=self.in_flight,
            queued_prefill_tokens=self.queued,
            decode_tokens=self.decode_tokens,
            capacity=self.settings.max_num_seqs,
        )


class _Sim:
    def __init__(self, reqs: list[PDRequest], fleet: PDFleet, costs: StepCosts, seed: int) -> None:
        self.fleet, self.costs = fleet, costs
        self.reqs = reqs
        mk = _Worker
        if fleet.mixed:
            self.decode = [mk(f"m{i}", "mixed", fleet.decode_settings) for i in range(fleet.mixed)]
            self.prefill: list[_Worker] = []
        else:
            self.decode = [mk(f"d{i}", "decode", fleet.decode_settings) for i in range(fleet.decode)]
            self.prefill = [mk(f"p{i}", "prefill", fleet.prefill_settings) for i in range(fleet.prefill)]
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.rr = {"prefill": 0, "decode": 0}
        self.rng = random.Random(seed)
        self.prefill_of: dict[int, _Worker] = {}
        self.decode_of: dict[int, _Worker] = {}

    def push(self, t: float, kind: str, obj: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def busy_threads(self, now: float) -> int:
        return sum(self.fleet.threads for w in self.decode + self.prefill if w.busy_until > now)

    # ------------------------------------------------------------------ the router

    def route(self, r: PDRequest, now: float) -> None:
        f = self.fleet
        mt = r.max_tokens or r.output_tokens
        req = RouteRequest(r.prompt_tokens, mt, f.block_size)
        d = self._pick("decode", f.decode_policy, req, self.decode)
        remote = bool(self.prefill) and r.prompt_tokens >= f.local_prefill_max_tokens
        d.in_flight += 1
        d.decode_tokens += mt
        if remote:
            p = self._pick(
                "prefill", f.prefill_policy, RouteRequest(r.prompt_tokens, 1, f.block_size), self.prefill
            )
            p.in_flight += 1
            p.queued += r.prompt_tokens
            self.prefill_of[r.rid] = p
            r.remote = True
        else:
            d.queued += r.prompt_tokens
        self.decode_of[r.rid] = d
        d.waiting.append(r)
        self.wake(d, now)

    def _pick(self, role: str, policy: str, req: RouteRequest, pool: list[_Worker]) -> _Worker:
        dec = choose(policy, req, [w.state() for w in pool], counter=self.rr[role], rng=self.rng)
        self.rr[role] += 1
        # Every worker past its capacity: the gateway would queue the request; the least busy takes it here.
        return next((w for w in pool if w.wid == dec.worker_id), None) or min(pool, key=lambda w: w.in_flight)

    def first_token(self, r: PDRequest, now: float) -> None:
        r.first_token = now
        r.generated = 1
        d = self.decode_of[r.rid]
        if r.remote:
            p = self.prefill_of[r.rid]
            p.queued -= r.prompt_tokens
            p.in_flight -= 1
        else:
            d.queued -= r.prompt_tokens
        d.decode_tokens -= 1

    def finish(self, w: _Worker, r: PDRequest, now: float) -> None:
        r.finish = now
        w.in_flight -= 1
        w.decode_tokens -= (r.max_tokens or r.output_tokens) - r.generated

    # ------------------------------------------------------------------ the workers

    def wake(self, w: _Worker, now: float) -> None:
        if w.busy_until > now:
            return  # it looks again at its step's end
        if w.role == "prefill":
            self.start_prefill_step(w, now)
        else:
            self.start_decode_step(w, now)

    def _scaled(self, seconds: float, now: float, w: _Worker, prefill: bool) -> float:
        """A step's time on the shared machine: slower beside another busy worker (memory bandwidth,
        measured), faster where a step has every other worker's cores to borrow (measured for decode
        steps and for steps with prompt tokens), and shared out when more threads compute than there
        are cores."""
        seconds += self.fleet.step_overhead_s
        cores = self.fleet.cores
        if any(o is not w and o.busy_until > now for o in self.decode + self.prefill):
            seconds *= self.costs.contended_prefill if prefill else self.costs.contended_decode
        elif cores and len(self.decode) + len(self.prefill) > 1:  # a lone worker has no peer to borrow from
            seconds *= self.fleet.prefill_lent if prefill else self.fleet.decode_lent
        if not cores:
            return seconds
        return seconds * max(1.0, (self.busy_threads(now) + self.fleet.threads) / cores)

    def start_decode_step(self, w: _Worker, now: float) -> None:
        s = w.settings
        for r in w.arrived:  # the KV is in: it decodes in this step; its first token goes out at the end
            w.loading -= 1
            w.shown.append(r)
            if r.output_tokens > 1:
                r.generated = 1  # the prefill worker's token: it decodes the next one now
                w.running.append(r)
        w.arrived.clear()
        budget = s.max_num_batched_tokens
        step: list[tuple[PDRequest, int]] = []
        for r in w.running:
            if budget <= 0:
                break
            n = 1 if r.generated else min(r.prompt_tokens - r.computed, budget)
            step.append((r, n))
            budget -= n
        peers: list[_Worker] = []  # prefill workers sent a job: woken once this step is under way
        while w.waiting and len(w.running) + w.loading < s.max_num_seqs:
            r = w.waiting[0]
            if r.remote:
                w.waiting.popleft()
                w.loading += 1
                p = self.prefill_of[r.rid]
                p.waiting.append(r)
                peers.append(p)
                continue
            if budget <= 0:
                break
            w.waiting.popleft()
            w.running.append(r)
            n = min(r.prompt_tokens, budget)
            step.append((r, n))
            budget -= n
        if step:
            self._run_decode_step(w, step, now)
        else:
            self._show_loaded(w, now)  # nothing to run: the outputs go out at once
        for p in peers:
            self.wake(p, now)

    def _run_decode_step(self, w: _Worker, step: list[tuple[PDRequest, int]], now: float) -> None:
        dec = [r for r, n in step if r.generated]
        pre = [(r, n) for r, n in step if not r.generated]
        pt = sum(n for _, n in pre)
        pctx = sum(r.computed * n for r, n in pre) / pt if pt else 0.0
        dctx = sum(r.prompt_tokens + r.generated for r in dec) / len(dec) if dec else 0.0
        dur = self._scaled(self.costs.step_s(len(dec), dctx, pt, pctx), now, w, pt > 0)
        w.step = step
        w.busy_until = now + dur
        self.push(now + dur, "step", w)

    def start_prefill_step(self, w: _Worker, now: float) -> None:
        s = w.settings
        budget = s.max_num_batched_tokens
        step: list[tuple[PDRequest, int]] = []
        for r in w.running:
            if budget <= 0:
                break
            n = min(r.prompt_tokens - r.computed, budget)
            step.append((r, n))
            budget -= n
        while w.waiting and len(w.running) < s.max_num_seqs and budget > 0:
            r = w.waiting.popleft()
            w.running.append(r)
            n = min(r.prompt_tokens, budget)
            step.append((r, n))
            budget -= n
        if not step:
            return
        pt = sum(n for _, n in step)
        pctx = sum(r.computed * n for r, n in step) / pt
        dur = self._scaled(self.costs.prefill_s(pt, round(pctx)), now, w, True)
        w.step = step
        w.busy_until = now + dur
        self.push(now + dur, "step", w)

    def _show_loaded(self, w: _Worker, now: float) -> None:
        for r in w.shown:
            self.first_token(r, now)
            if r.output_tokens <= 1:
                self.finish(w, r, now)
        w.shown.clear()

    def end_step(self, w: _Worker, now: float) -> None:
        step, w.step = w.step, []
        self._show_loaded(w, now)
        for r, n in step:
            if r.generated:
                r.generated += 1
                w.decode_tokens -= 1
                if r.generated >= r.output_tokens:
                    w.running.remove(r)
                    self.finish(w, r, now)
                continue
            r.computed += n
            if r.computed < r.prompt_tokens:
                continue
            if w.role == "prefill":
                w.running.remove(r)
                self.push(now + self.costs.exposed_transfer_s(r.prompt_tokens), "kv", r)
            else:
                self.first_token(r, now)
                if r.generated >= r.output_tokens:
                    w.running.remove(r)
                    self.finish(w, r, now)
        self.wake(w, now)

    def run(self) -> None:
        for r in self.reqs:
            self.push(r.arrival, "arrive", r)
        while self.events:
            now, _, kind, obj = heapq.heappop(self.events)
            if kind == "arrive":
                assert isinstance(obj, PDRequest)
                self.route(obj, now)
            elif kind == "step":
                assert isinstance(obj, _Worker)
                self.end_step(obj, now)
            else:  # "kv": a prefilled prompt's KV reached its decode worker
                assert isinstance(obj, PDRequest)
                d = self.decode_of[obj.rid]
                d.arrived.append(obj)
                self.wake(d, now)


def simulate_pd(
    requests: list[PDRequest], fleet: PDFleet, costs: StepCosts, seed: int = 0
) -> list[PDRequest]:
    """Run `requests` (copied: one trace serves every fleet) through `fleet`; returns the copies with
    first_token and finish filled in (fleet.overhead_s, or remote_overhead_s for a prompt a prefill
    worker computed, is added to both)."""
    if (fleet.mixed == 0) and (fleet.prefill < 0 or fleet.decode < 1):
        raise ValueError("a PD fleet needs at least one decode worker")
    reqs = [
        PDRequest(r.rid, r.arrival, r.prompt_tokens, max(1, r.output_tokens), r.max_tokens) for r in requests
    ]
    _Sim(reqs, fleet, costs, seed).run()
    for r in reqs:
        if r.finish < 0:
            raise RuntimeError(f"request {r.rid} never finished (simulator bug)")
        extra = fleet.remote_overhead_s if r.remote else fleet.overhead_s
        r.first_token += extra
        r.finish += extra
    return reqs
