"""router.hold_prefill: the router holds a prompt for the prefill pool until a prefill worker has room
(less than a step's budget queued by the router's own figures), so a prefill worker that appears
meanwhile (a role switch) takes the held prompts instead of the busy one they would have queued on.

No network: the router's own route(), Charge and PrefillHold over a registry."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from pdserve.config import load_config
from pdserve.router.accounting import Charge, Route
from pdserve.router.backend import RemoteBackend
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Registry

PROMPT, MAX_TOKENS, BUDGET = 300, 16, 512


def _router(hold: bool = True, timeout_s: float = 30.0) -> tuple[RemoteBackend, Registry]:
    config = load_config(
        None,
        {
            "router.hold_prefill": hold,
            "router.queue_timeout_s": timeout_s,
            "deployment.prefill.max_num_batched_tokens": BUDGET,
        },
    )
    registry = Registry(
        breaker_failures=2, breaker_cooldown_s=60.0, heartbeat_timeout_s=10.0, internal_headers={}
    )
    for role in ("prefill", "decode"):
        _add(registry, role)
    metrics = RouterMetrics(CollectorRegistry(), registry)
    return RemoteBackend(config, registry, None, None, metrics, None, None, lambda who, n: None), registry


def _add(registry: Registry, role: str):
    w = registry.add_static(f"http://127.0.0.1:{9000 + len(registry.workers)}", role)
    w.healthy, w.kv_endpoint = True, f"tcp://127.0.0.1:{9100 + len(registry.workers)}"
    return w


def _prompt(i: int) -> list[int]:
    return [(7919 * i + 31 * j) % 30000 + 100 for j in range(PROMPT)]


async def _send(backend: RemoteBackend, i: int, order: list[int]) -> tuple[Route, Charge]:
    """What RemoteBackend.generate does up to the stream: route (held or not), then charge the route."""
    route, reason = await backend.hold.route(
        lambda: backend.route(_prompt(i), MAX_TOKENS, None, set()), PROMPT
    )
    assert route is not None, reason
    order.append(i)
    return route, Charge(route, PROMPT, MAX_TOKENS)


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_held_prompts_go_to_a_prefill_worker_that_appears_in_arrival_order():
    async def run() -> None:
        backend, registry = _router()
        busy = registry.pool("prefill")[0]
        order: list[int] = []
        # Two prompts fill the one prefill worker's step budget (600 >= 512): they are sent at once.
        first = [await _send(backend, i, order) for i in range(2)]
        assert all(r.prefill is busy for r, _ in first) and busy.queued_prefill_tokens == 2 * PROMPT
        held = [asyncio.create_task(_send(backend, i, order)) for i in (2, 3)]
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in held) and backend.held_prefill_tokens() == 2 * PROMPT
        new = _add(registry, "prefill")  # e.g. a decode worker switched to prefill
        done = await asyncio.gather(*held)
        assert order == [0, 1, 2, 3]
        assert all(r.prefill is new for r, _ in done) and new.queued_prefill_tokens == 2 * PROMPT
        assert busy.queued_prefill_tokens == 2 * PROMPT and backend.held_prefill_tokens() == 0
        assert backend.hold.held_total == 2

    asyncio.run(run())


def test_a_held_prompt_starts_when_a_first_token_frees_room_and_short_prompts_are_never_held():
    async def run() -> None:
        backend, registry = _router()
        busy = registry.pool("prefill")[0]
        order: list[int] = []
        charges = [(await _send(backend, i, order))[1] for i in range(2)]
        held = asyncio.create_task(_send(backend, 2, order))
        await asyncio.sleep(0.1)
        assert not held.done()
        # A prompt the decode worker prefills itself (shorter than local_prefill_max_tokens) goes at once.
        route, _ = await backend.hold.route(
            lambda: backend.route(list(range(100, 110)), MAX_TOKENS, None, set()), 10
        )
        assert route is not None and route.remote_tokens == 0
        charges[0].first_token()  # its prefill is done: room on the busy worker again
        await _until(held.done)
        route, _ = held.result()
        assert route.prefill is busy and busy.queued_prefill_tokens == 2 * PROMPT

    asyncio.run(run())


def test_a_prompt_held_past_the_queue_timeout_goes_to_the_route_it_gets_then():
    async def run() -> None:
        backend, registry = _router(timeout_s=0.2)
        order: list[int] = []
        for i in range(2):
            await _send(backend, i, order)
        route, _ = await asyncio.wait_for(_send(backend, 2, order), timeout=10)
        assert route.prefill is registry.pool("prefill")[0] and backend.hold.held_total == 1

    asyncio.run(run())


def test_off_by_default():
    backend, _ = _router(hold=False)
    assert backend.hold is None and backend.held_prefill_tokens() == 0
    assert load_config(None, {}).router.hold_prefill is False
