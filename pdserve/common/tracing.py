"""Request tracing with OpenTelemetry: one trace per request across the router and the workers.

Off unless `server.otlp_endpoint` (or OTEL_EXPORTER_OTLP_ENDPOINT) names a collector; then each
process exports its spans over OTLP/HTTP (`<endpoint>/v1/traces`) under its own service name. The
router opens the request's root span (router/security.py, whose audit line carries the trace id,
as do error bodies) and passes the W3C `traceparent` header to the decode worker, whose spans join
the same trace. Without the optional packages (`pip install 'pdserve[tracing]'`) or an endpoint,
every call here is a cheap no-op.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)
TRACEPARENT = "traceparent"
_state: dict[str, Any] = {"on": False}


def setup(service: str, endpoint: str | None) -> bool:
    """Export this process's spans to `endpoint` (e.g. http://collector:4318); False when off."""
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or _state["on"]:
        return _state["on"]
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as e:
        log.warning(
            "tracing: %s is set but OpenTelemetry is not installed (pip install 'pdserve[tracing]'): %s",
            endpoint,
            e,
        )
        return False
    # host.name: which host a span came from, as a trace crosses hosts (several run one service).
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "host.name": socket.gethostname()})
    )
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces"), schedule_delay_millis=500
        )
    )
    atexit.register(provider.shutdown)  # the last spans go out at exit
    _state.update(
        on=True,
        tracer=provider.get_tracer("pdserve"),
        propagator=TraceContextTextMapPropagator(),
        trace=trace,
        provider=provider,
    )
    log.info("tracing: spans of %s go to %s", service, endpoint)
    return True


def enabled() -> bool:
    return bool(_state["on"])


@contextmanager
def span(name: str, traceparent: str | None = None, **attributes: Any) -> Iterator[Any]:
    """A span around the block, the current one's child (or `traceparent`'s, from another process);
    yields it (None when tracing is off) for `event()` and attributes."""
    if not _state["on"]:
        yield None
        return
    ctx = _state["propagator"].extract({TRACEPARENT: traceparent}) if traceparent else None
    with _state["tracer"].start_as_current_span(name, context=ctx, attributes=attributes) as s:
        yield s


def start(name: str, traceparent: str | None = None, start_time: int | None = None, **attributes: Any) -> Any:
    """A span that is not made current (it may end in another task or thread: a stream's attempt,
    a request's stay on a worker), the current span's child or `traceparent`'s, begun now or at
    `start_time` (time.time_ns()); None when off. End it with end()."""
    if not _state["on"]:
        return None
    ctx = _state["propagator"].extract({TRACEPARENT: traceparent}) if traceparent else None
    return _state["tracer"].start_span(name, context=ctx, attributes=attributes, start_time=start_time)


def end(s: Any, error: str | None = None) -> None:
    if s is None:
        return
    if error:
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, error))
    s.end()


def traceparent_of(s: Any) -> str | None:
    """`s` as a W3C traceparent header value (the next hop's parent)."""
    if s is None:
        return None
    carrier: dict[str, str] = {}
    _state["propagator"].inject(carrier, context=_state["trace"].set_span_in_context(s))
    return carrier.get(TRACEPARENT)


def event(name: str, **attributes: Any) -> None:
    """An event on the current span (a migration, a retry)."""
    if _state["on"]:
        _state["trace"].get_current_span().add_event(name, attributes)


def traceparent() -> str | None:
    """The current span as a W3C traceparent header value, for the next hop."""
    if not _state["on"]:
        return None
    carrier: dict[str, str] = {}
    _state["propagator"].inject(carrier)
    return carrier.get(TRACEPARENT)


def trace_id() -> str | None:
    """The current trace's id (32 hex digits) for log lines and error bodies; None when off."""
    if not _state["on"]:
        return None
    ctx = _state["trace"].get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


# request id -> its trace on this worker, for the engine thread's KV-plane spans (the engine itself
# carries no trace context). Written by the HTTP handler, read by the decode connector.
_requests: dict[str, str] = {}


def remember(request_id: str, traceparent: str | None) -> None:
    if traceparent:
        _requests[request_id] = traceparent


def recall(request_id: str) -> str | None:
    return _requests.get(request_id)


def forget(request_id: str) -> None:
    _requests.pop(request_id, None)


def flush(timeout_s: float = 5.0) -> None:
    if _state["on"]:
        _state["provider"].force_flush(int(timeout_s * 1000))
