"""A discrete-time simulator of a routed fleet, for comparing routing policies without a model.

Each simulated worker holds a real PrefixCache over a real BlockPool (a block budget with LRU
eviction) and publishes what it stores and evicts as KVEvents; the simulated gateway feeds them
into a real KVIndex one step later and routes with the same policy functions the gateway uses.
The load model is deliberately plain: a worker prefills FIFO at `prefill_speed` tokens per step
and decodes `decode_speed` tokens per step shared by its decoding requests (at most one token per
request per step). A request holds KV blocks for its prompt and max_tokens from the start of its
prefill to its end; it waits at the head of the queue while the pool lacks room.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cache.block_pool import BlockPool, NoFreeBlocks
from pdserve.cache.kv_index import KVIndex
from pdserve.cache.prefix_cache import PrefixCache, block_hash, prompt_hashes
from pdserve.protocol import KVEvent, KVEventType
from pdserve.router.policies import CostParams, Decision, RouteRequest, WorkerState, choose, eligible

# A router policy for the simulator: (request hashes, RouteRequest, worker states) -> Decision.
SimPolicy = Callable[[list[bytes], RouteRequest, list[WorkerState]], Decision]


@dataclass
class SimRequest:
    rid: int
    arrival: int  # step
    hashes: list[bytes]  # chained hashes of the prompt's full blocks
    num_prompt_tokens: int
    max_tokens: int
    output_tokens: int  # what it really generates (<= max_tokens; the router only knows max_tokens)
    # filled in while it runs
    predicted_uncached: int = 0
    hit_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    remaining_prefill: int = -1  # -1: prefill not started
    generated: float = 0.0
    streamed: int = 0
    first_token: int = -1
    finish: int = -1
    tokens: list[int] | None = None  # kept only on request (tests)
    salt: str | None = None


@dataclass
class TraceConfig:
    num_requests: int = 4000
    num_tenants: int = 40
    num_system_prompts: int = 300  # spread over the tenants; each tenant has its own cache salt
    zipf_s: float = 1.1  # system-prompt popularity
    system_tokens: tuple[int, int] = (256, 2048)
    user_tokens: tuple[int, int] = (16, 512)
    long_fraction: float = 0.05  # requests that also carry a unique document (RAG-like)
    long_tokens: tuple[int, int] = (4096, 8192)
    max_tokens: tuple[int, int] = (64, 512)
    rate: float = 1.5  # Poisson arrivals per step: 8 workers ~50% busy decoding, prefill
    # ~55% busy at the oracle's hit rate, ~80% at round robin's
    block_size: int = 16
    seed: int = 0


def multi_tenant_trace(cfg: TraceConfig, keep_tokens: bool = False) -> list[SimRequest]:
    """Zipf-popular system prompts + a fresh user suffix per request, Poisson arrivals; seeded."""
    rng = random.Random(cfg.seed)
    bs = cfg.block_size
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_system_prompts)]
    rng.shuffle(weights)  # popularity unrelated to tenant or length
    prompts = []
    for k in range(cfg.num_system_prompts):
        toks = [rng.randrange(50_000) for _ in range(rng.randint(*cfg.system_tokens))]
        salt = f"tenant-{k % cfg.num_tenants}"
        prompts.append((toks, salt, prompt_hashes(toks, bs, salt)))
    out, t = [], 0.0
    for rid in range(cfg.num_requests):
        t += rng.expovariate(cfg.rate)
        toks, salt, sys_hashes = rng.choices(prompts, weights)[0]
        tail = [rng.randrange(50_000) for _ in range(rng.randint(*cfg.user_tokens))]
        if rng.random() < cfg.long_fraction:
            tail += [rng.randrange(50_000) for _ in range(rng.randint(*cfg.long_tokens))]
        # Hash only what follows the system prompt's full blocks: equal to prompt_hashes(toks + tail).
        full = len(sys_hashes)
        hashes = list(sys_hashes)
        rest = toks[full * bs :] + tail
        parent = hashes[-1] if hashes else None
        for s in range(0, len(rest) - bs + 1, bs):
            parent = block_hash(parent, rest[s : s + bs], salt)
            hashes.append(parent)
        max_tokens = rng.randint(*cfg.max_tokens)
        out.append(
            SimRequest(
                rid,
                int(t),
                hashes,
                len(toks) + len(tail),
                max_tokens,
                max(1, int(max_tokens * rng.uniform(0.2, 1.0))),
                tokens=toks + tail if keep_tokens else None,
                salt=salt if keep_tokens else None,
            )
        )
    return out


@dataclass
class FleetConfig:
    num_workers: int = 8
    num_blocks: int = 8192  # KV budget per worker (128k tokens at block 16)
    block_size: int = 16
    prefill_speed: int = 256  # tokens per step (a step is 20 ms: 12.8k tokens/s)
    decode_speed: int = 64  # tokens per step over all its decoding requests
    capacity: int = 64  # max_num_seqs


class SimWorker:
    def __init__(self, worker_id: str, fc: FleetConfig) -> None:
        self.worker_id = worker_id
        self.fc = fc
        self._log: list[tuple[KVEventType, str]] = []
        self.cache = PrefixCache(fc.block_size, listener=self._on_cache)
        self.pool = BlockPool(fc.num_blocks, self.cache)
        self.queue: deque[SimRequest] = deque()
        self.decoding: list[SimRequest] = []
        self.seq = 0
        self.evicted = 0
        # the gateway's view (it knows what it sent and what was streamed back)
        self.in_flight = 0
        self.queued_est = 0
        self.decode_est = 0
        # what happened, for the load figures
        self.prompt_tokens = 0
        self.prefilled = 0
        self.decoded = 0.0

    def _on_cache(self, kind: KVEventType, h: bytes, parent: bytes | None) -> None:
        self.evicted += kind == "removed"
        self._log.append((kind, h.hex()))

    def events(self) -> list[KVEvent]:
        """This step's cache changes as events, one per run of the same kind, in order."""
        out: list[KVEvent] = []
        for kind, h in self._log:
            if out and out[-1].type == kind:
                out[-1].block_hashes.append(h)
            else:
                self.seq += 1
                out.append(
                    KVEvent(type=kind, block_hashes=[h], worker_id=self.worker_id, seq=self.seq, ts=0.0)
                )
        self._log.clear()
        return out

    def state(self) -> WorkerState:
        pool = self.pool
        return WorkerState(
            self.worker_id,
            "mixed",
            in_flight=self.in_flight,
            queued_prefill_tokens=self.queued_est,
            decode_tokens=round(self.decode_est),
            kv_usage=pool.usage(),
            kv_free_blocks=pool.num_free,
            kv_total_blocks=pool.num_blocks,
            capacity=self.fc.capacity,
        )

    def submit(self, r: SimRequest) -> None:
        self.queue.append(r)
        self.in_flight += 1
        self.queued_est += r.predicted_uncached
        self.decode_est += r.max_tokens
        self.prompt_tokens += r.num_prompt_tokens

    def _start(self, r: SimRequest) -> bool:
        bs = self.fc.block_size
        matched = self.cache.match(r.hashes)
        self.pool.incref(matched)  # before allocating, so eviction cannot take them
        need = -(-(r.num_prompt_tokens + r.max_tokens) // bs) - len(matched)
        try:
            fresh = self.pool.allocate(need)
        except NoFreeBlocks:
            self.pool.free(matched)
            return False
        r.blocks = matched + fresh
        r.hit_tokens = min(len(matched) * bs, r.num_prompt_tokens - 1)
        r.remaining_prefill = r.num_prompt_tokens - r.hit_tokens
        return True

    def _prefilled(self, r: SimRequest, now: int) -> None:
        for i in range(len(r.hashes)):  # computed blocks join the cache (hits are there already)
            self.cache.insert(r.hashes[i], r.hashes[i - 1] if i else None, r.blocks[i])
        r.first_token = now
        self.queued_est -= r.predicted_uncached
        self.decoding.append(r)

    def step(self, now: int) -> list[SimRequest]:
        """One step of prefill then decode; returns the requests that finished."""
        budget = self.fc.prefill_speed
        while self.queue and budget > 0:
            r = self.queue[0]
            if r.remaining_prefill < 0 and not self._start(r):
                break  # no KV room: wait for running requests to finish
            done = min(budget, r.remaining_prefill)
            budget -= done
            r.remaining_prefill -= done
            self.prefilled += done
            if r.remaining_prefill == 0:
                self.queue.popleft()
                self._prefilled(r, now)
        finished = []
        if self.decoding:
            rate = min(1.0, self.fc.decode_speed / len(self.decoding))
            still = []
            for r in self.decoding:
                r.generated += rate
                self.decoded += rate
                streamed = min(int(r.generated), r.output_tokens)
                self.decode_est -= streamed - r.streamed
                r.streamed = streamed
                if streamed >= r.output_tokens:
                    r.finish = now
                    self.decode_est -= r.max_tokens - streamed  # the rest was never coming
                    self.in_flight -= 1
                    self.pool.free(r.blocks)
                    finished.append(r)
                else:
                    still.append(r)
            self.decoding = still
        return finished

    def busy(self) -> float:
        """Steps of work done: prefill at prefill_speed plus decode at decode_speed."""
        return self.prefilled / self.fc.prefill_speed + self.decoded / self.fc.decode_speed


def policy(name: str, params: CostParams | None = None, seed: int = 0) -> SimPolicy:
    """A named policy from pdserve.router.policies, with the counter/RNG a gateway would keep."""
    counter = [0]
    rng = random.Random(seed)

    def run(hashes: list[bytes], req: RouteRequest, states: list[WorkerState]) -> Decision:
        d = choose(name, req, states, counter=counter[0], rng=rng, params=params)
        counter[0] += 1
        return d

    return run


def oracle(workers: dict[str, SimWorker], params: CostParams | None = None) -> SimPolicy:
    """Knows every cache exactly: among non-overloaded workers, the longest true prefix match,
    ties by fewest outstanding tokens. An upper reference for hit rate, blind to balance."""

    def run(hashes: list[bytes], req: RouteRequest, states: list[WorkerState]) -> Decision:
        cands = eligible(states, params)
        if not cands:
            return Decision(None, "overloaded")
        best = max(
            cands,
            key=lambda w: (
                len(workers[w.worker_id].cache.match(hashes)),
                -(w.queued_prefill_tokens + w.decode_tokens),
            ),
        )
        return Decision(best.worker_id, "oracle")

    return run


@dataclass
class SimResult:
    hit_rate: float  # hit tokens / prompt tokens, measured at each prefill start
    load_max_mean: float  # max/mean of per-worker busy steps (prefill + decode work)
    prompt_max_mean: float  # max/mean of prompt tokens assigned (cached or not)
    ttft_mean: float  # steps, arrival to first token (admission wait included)
    ttft_p99: float
    steps: int
    reasons: dict[str, int]
    fleet: dict[str, SimWorker] = field(repr=False, default_factory=dict)
    index: KVIndex = field(repr=False, default_factory=KVIndex)


def simulate(
    trace: list[SimRequest],
    make_policy: Callable[[dict[str, SimWorker]], SimPolicy],
    fc: FleetConfig | None = None,
    max_steps: int = 1_000_000,
) -> SimResult:
    """Replay `trace` (copied, so one trace serves every policy) through a fresh fleet."""
    fc = fc or FleetConfig()
    workers = {f"w{i}": SimWorker(f"w{i}", fc) for i in range(fc.num_workers)}
    route = make_policy(workers)
    index = KVIndex()
    reqs = [
        SimRequest(r.rid, r.arrival, r.hashes, r.num_prompt_tokens, r.max_tokens, r.output_tokens)
        for r in trace
    ]
    admission: deque[SimRequest] = deque()  # the gateway's queue while everyone is overloaded
    reasons: dict[str, int] = {}
    nxt, done, now = 0, 0, 0
    while done < len(reqs):
        if now >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            admission.append(reqs[nxt])
            nxt += 1
        states = {wid: w.state() for wid, w in workers.items()}  # health polled once a step
        while admission:
            r = admission[0]
            req = RouteRequest(r.num_prompt_tokens, r.max_tokens, fc.block_size, index.match(r.hashes))
            d = route(r.hashes, req, list(states.values()))
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
            if d.worker_id is None:
                break
            admission.popleft()
            hit = req.cache_hits.get(d.worker_id)
            cached = min(hit[0] * fc.block_size, r.num_prompt_tokens - 1) if hit else 0
            r.predicted_uncached = r.num_prompt_tokens - cached
            w = workers[d.worker_id]
            w.submit(r)
            states[d.worker_id] = w.state()
        for w in workers.values():
            done += len(w.step(now))
        for w in workers.values():  # events reach the router's index after the step
            for ev in w.events():
                index.apply(ev)
        now += 1
    hit_rate = sum(r.hit_tokens for r in reqs) / sum(r.num_prompt_tokens for r in reqs)
    busy = [w.busy() for w in workers.values()]
    prompt = [w.prompt_tokens for w in workers.values()]
    ttft = sorted(r.first_token + 1 - r.arrival for r in reqs)
    return SimResult(
        hit_rate,
        max(busy) / (sum(busy) / len(busy)),
        max(prompt) / (sum(prompt) / len(prompt)),
        sum(ttft) / len(ttft),
        ttft[min(len(ttft) - 1, math.ceil(0.99 * len(ttft)) - 1)],
        now,
        reasons,
        workers,
        index,
    )
