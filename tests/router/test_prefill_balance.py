"""The prefill pool shares the work: the router counts each request on the prefill worker it names
(router/accounting.py), so the policies it runs see that worker's queue and spread uncached
prompts, and each worker's circuit breaker hears the verdicts the decode worker reports about it.

No network: the router's own route() and Charge over a registry, which is what the policies read
(the end-to-end check with real workers is test_prefill_balance_e2e.py)."""

from __future__ import annotations

import collections
import time

import pytest
from prometheus_client import CollectorRegistry

from pdserve.config import load_config
from pdserve.protocol.stream import TokenLine
from pdserve.router.accounting import Charge, Route, remote_prefill_tokens
from pdserve.router.backend import RemoteBackend
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import POLICIES
from pdserve.router.registry import BreakerState, Registry

N, PROMPT, MAX_TOKENS = 12, 330, 16


def _router(policy: str, n_prefill: int = 2) -> tuple[RemoteBackend, Registry]:
    config = load_config(None, {"load_balancer.prefill": policy, "load_balancer.decode": policy})
    registry = Registry(
        breaker_failures=2, breaker_cooldown_s=60.0, heartbeat_timeout_s=10.0, internal_headers={}
    )
    for i, role in enumerate(["prefill"] * n_prefill + ["decode"]):
        w = registry.add_static(f"http://127.0.0.1:{9000 + i}", role)
        w.healthy, w.kv_endpoint = True, f"tcp://127.0.0.1:{9100 + i}"
    metrics = RouterMetrics(CollectorRegistry(), registry)
    backend = RemoteBackend(config, registry, None, None, metrics, None, None, lambda who, n: None)
    return backend, registry


def _prompt(i: int) -> list[int]:
    return [(7919 * i + 31 * j) % 30000 + 100 for j in range(PROMPT)]


def _route(backend: RemoteBackend, i: int) -> Route:
    route, reason = backend.route(_prompt(i), MAX_TOKENS, None, set())
    assert route is not None, reason
    return route


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_concurrent_uncached_prompts_spread_over_the_prefill_pool(policy):
    backend, registry = _router(policy)
    charges = [Charge(route, PROMPT, MAX_TOKENS) for route in (_route(backend, i) for i in range(N))]
    assert all(c.prefill is not None and c.remote == PROMPT for c in charges)
    per_worker = collections.Counter(c.prefill.worker_id for c in charges)
    assert per_worker == {"prefill-1": N // 2, "prefill-2": N // 2}, per_worker
    # The prefill workers carry the queue; the decode worker computes none of these prompts itself.
    prefill, decode = registry.pool("prefill"), registry.pool("decode")[0]
    assert [(w.in_flight, w.queued_prefill_tokens) for w in prefill] == [(N // 2, N // 2 * PROMPT)] * 2
    assert (decode.in_flight, decode.queued_prefill_tokens, decode.decode_tokens) == (N, 0, N * MAX_TOKENS)
    for c in charges[:3]:  # first tokens back: the prefill part is done
        c.first_token()
        c.generated(5)
    assert sum(w.in_flight for w in prefill) == N - 3
    for c in charges:
        c.close()
        c.close()  # idempotent: a figure is given back exactly once
    for w in registry.workers.values():
        assert (w.in_flight, w.queued_prefill_tokens, w.decode_tokens) == (0, 0, 0), w.describe()


@pytest.mark.parametrize("policy", ["cost", "least_load", "cache_aware"])
def test_requests_that_finish_before_the_next_one_still_spread(policy):
    """An idle fleet is an exact tie every time: the tie rotates instead of going to the first worker."""
    backend, _ = _router(policy, n_prefill=3)
    picked = collections.Counter()
    for i in range(N):
        c = Charge(_route(backend, i), PROMPT, MAX_TOKENS)
        picked[c.prefill.worker_id] += 1
        c.close()
    assert picked == {"prefill-1": 4, "prefill-2": 4, "prefill-3": 4}, picked


def test_a_prompt_the_decode_worker_prefills_itself_is_not_charged_to_a_prefill_worker():
    assert remote_prefill_tokens(330, None, 16, 64) == 330
    assert remote_prefill_tokens(330, (16, "device"), 16, 64) == 330 - 16 * 16
    assert remote_prefill_tokens(330, (16, "disk"), 16, 64) == 330 - 16 * 16  # any tier counts as cached
    assert remote_prefill_tokens(330, (17, "device"), 16, 64) == 0  # 58 left: under the threshold
    assert remote_prefill_tokens(40, None, 16, 64) == 0
    assert remote_prefill_tokens(330, None, 16, None) == 0  # remote prefill disabled
    backend, registry = _router("cost")
    route, _ = backend.route(_prompt(0)[:20], MAX_TOKENS, None, set())
    assert route.prefill is not None and route.remote_tokens == 0
    c = Charge(route, 20, MAX_TOKENS)
    assert c.prefill is None and registry.pool("decode")[0].queued_prefill_tokens == 20
    assert all(w.in_flight == 0 for w in registry.pool("prefill"))
    c.close()


def test_failures_count_against_the_prefill_worker_that_failed():
    """The decode worker's first line names the prefill worker that failed its job and the one
    that filled the prompt after it: the first one's breaker opens, the decode worker's does not."""
    backend, registry = _router("cost")
    p1, p2 = registry.pool("prefill")
    decode = registry.pool("decode")[0]
    line = TokenLine.from_wire(
        {
            "token_ids": [5],
            "finished": False,
            "finish_reason": None,
            "prefill_failed": [p1.kv_endpoint],
            "prefilled_by": p2.kv_endpoint,
        }
    )
    for _ in range(2):
        judged: set[str] = set()
        backend._judge_prefill(line, time.monotonic(), judged)
        assert judged == {p1.worker_id, p2.worker_id}
    assert (p1.errors, p1.breaker.state) == (2, BreakerState.OPEN)
    assert (p2.errors, p2.breaker.state, decode.errors) == (0, BreakerState.CLOSED, 0)
    for i in range(4):  # an open breaker: every prompt goes to the other one
        assert _route(backend, i).prefill is p2
