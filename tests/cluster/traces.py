"""Checks on the traces the cluster's processes export (tracing on: each process sends its spans to
the OTLP receiver in the test process, tests/otlp_receiver.py): one request is one trace across the
router, prefill and decode hosts, a request that migrated after a decode host failed included, and
its trace id is in the router's audit line and in error bodies."""

from __future__ import annotations

import re
import time

import httpx
from cluster.pd_cluster import MODEL, PDCluster, prompt

ROUTER_SPANS = {"POST /v1/completions", "router.queue", "router.route", "router.attempt"}
DECODE_SPANS = {"worker.generate", "worker.prefill", "kv.transfer", "worker.decode"}
PREFILL_SPANS = {"prefill.job"}


def audit_traces(log: str, path: str, status: int) -> list[str]:
    """Trace ids of the router's audit lines for `path` answered with `status`, oldest first."""
    return re.findall(rf"POST {re.escape(path)} status={status} ms=\S+ trace=([0-9a-f]{{32}})", log)


def audit_trace(log: str, path: str, status: int) -> str:
    found = audit_traces(log, path, status)
    assert found, log[-3000:]
    return found[-1]


def hosts_of(c: PDCluster, trace_id: str) -> dict[str, set[str]]:
    """Span names of the trace by the cluster host that exported them (a process's host.name is its
    namespace's hostname, `<host>-<cluster tag>`)."""
    out: dict[str, set[str]] = {}
    for s in c.receiver.trace(trace_id):
        out.setdefault(s.host.removesuffix(f"-{c.net.tag}"), set()).add(s.name)
    return out


def _wait(what: str, check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _covers(by_host: dict[str, set[str]], decode: str | None = None) -> bool:
    """The trace has the router's spans, a decode host's (`decode` when given) and a prefill host's."""
    return (
        ROUTER_SPANS <= by_host.get("router", set())
        and any(
            DECODE_SPANS <= v for h, v in by_host.items() if h.startswith("decode") and decode in (None, h)
        )
        and any(PREFILL_SPANS <= v for h, v in by_host.items() if h.startswith("prefill"))
    )


def check_one_trace(c: PDCluster) -> None:
    """One streamed request: one trace with spans from the router host (root, queueing, routing,
    the attempt), a decode host (its stay, the prefill by a peer, the KV transfer, the decode) and a
    prefill host (the job it ran); a refused request's error body names its trace, as does the audit line."""

    def ok_lines() -> list[str]:
        return audit_traces(c.router.log_tail(2_000_000), "/v1/completions", 200)

    before = len(ok_lines())
    out = c.stream(prompt(5, 120), 8)
    assert out.error is None, out
    tid = _wait("the request's audit line", lambda: (ok_lines()[before:] or [None])[-1])
    by_host = _wait(
        f"trace {tid} to span router, decode and prefill hosts",
        lambda: (lambda h: h if _covers(h) else None)(hosts_of(c, tid)),
    )
    assert set(by_host) <= {"router", "prefill-a", "prefill-b", "decode-a", "decode-b"}, by_host
    r = httpx.post(
        c.router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0}, timeout=30
    )
    assert r.status_code == 400, r.text
    bad = r.json()["error"]["trace_id"]
    assert bad != tid
    _wait(
        "the refused request's audit line",
        lambda: bad in audit_traces(c.router.log_tail(2_000_000), "/v1/completions", 400),
    )
    _wait(
        "the refused request's root span",
        lambda: "POST /v1/completions" in hosts_of(c, bad).get("router", set()),
    )


def check_migrated_trace(c: PDCluster, victim: str, fault_at: float) -> str:
    """After `victim`'s link went down mid-stream: a request that migrated is one trace holding the
    router's migration span, the attempt on another decode host (worker.generate with the tokens
    streamed so far) and that host's prefill by a prefill host; its id is in the audit line."""

    def migrated() -> str | None:
        with c.receiver.lock:
            ids = {s.trace_id for s in c.receiver.spans if s.name == "router.migration"}
        for tid in ids:
            spans = c.receiver.trace(tid)
            moved = {
                s.host.removesuffix(f"-{c.net.tag}")
                for s in spans
                if s.name == "worker.generate" and (s.attrs.get("tokens_so_far") or 0) > 0
            }
            if moved - {victim} and _covers(hosts_of(c, tid), decode=next(iter(moved - {victim}))):
                return tid
        return None

    tid = _wait("a migrated request's trace across router, prefill and the new decode host", migrated)
    assert tid in audit_traces(c.router.log_tail(2_000_000), "/v1/completions", 200)
    return tid
