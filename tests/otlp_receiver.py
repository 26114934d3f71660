"""A real OTLP/HTTP trace receiver for tests: a small HTTP server taking the protobuf export
requests that pdserve's processes send to `<endpoint>/v1/traces`, keeping every span's service,
host, name, trace id and attributes."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb


@dataclass(frozen=True)
class Span:
    service: str
    host: str  # the exporting process's host.name (its namespace's hostname in tests/cluster)
    name: str
    trace_id: str
    attrs: dict[str, Any]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Receiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                req = pb.ExportTraceServiceRequest.FromString(body)
                with outer.lock:
                    for rs in req.resource_spans:
                        res = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                outer.spans.append(
                                    Span(
                                        res.get("service.name", "?"),
                                        res.get("host.name", "?"),
                                        s.name,
                                        s.trace_id.hex(),
                                        {a.key: _value(a.value) for a in s.attributes},
                                    )
                                )
                out = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def of(self, trace_id: str) -> list[tuple[str, str]]:
        """(service, span name) of the trace's spans."""
        return [(s.service, s.name) for s in self.trace(trace_id)]

    def attrs(self, trace_id: str, name: str) -> dict:
        return next(s.attrs for s in self.trace(trace_id) if s.name == name)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
