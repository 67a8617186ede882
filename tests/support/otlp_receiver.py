"""A tiny OTLP/HTTP receiver for tests: ``POST /v1/traces`` bodies (protobuf
``ExportTraceServiceRequest``) decoded into flat span records.

Point a process at it with ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=<receiver.url>`` (or
``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.base>``); it answers 200 with an empty
``ExportTraceServiceResponse``. Needs ``opentelemetry-proto`` (installed with
``kvd[otel]``, and by vLLM).
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str = ""  # the status message of an error span
    is_error: bool = False
    events: list[str] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - stdlib naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._take(req)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self.base = f"http://{host}:{self._server.server_address[1]}"
        self.url = self.base + "/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _take(self, req: Any) -> None:
        out = []
        for rs in req.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(SpanRecord(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.message, is_error=s.status.code == 2,
                        events=[e.name for e in s.events], resource=attrs))
        with self._lock:
            self.spans.extend(out)

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def waterfall(spans: list[SpanRecord], width: int = 48) -> str:
    """One trace drawn as text, a line per span, children under their parent, each bar
    placed on the trace's time axis (what Jaeger or Tempo draw)."""
    if not spans:
        return ""
    t0 = min(s.start_ns for s in spans)
    total = max(max(s.end_ns for s in spans) - t0, 1)
    children: dict[str, list[SpanRecord]] = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda s: (s.start_ns, s.name)):
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines: list[str] = []

    def draw(s: SpanRecord, depth: int) -> None:
        a = int((s.start_ns - t0) / total * width)
        b = max(a + 1, int((s.end_ns - t0) / total * width))
        bar = " " * a + "#" * (b - a) + " " * (width - b)
        label = f"{'  ' * depth}{s.name} ({s.service})" + (" ERROR" if s.is_error else "")
        lines.append(f"{label:<52} |{bar}| {(s.end_ns - s.start_ns) / 1e6:9.3f} ms")
        for c in children.get(s.span_id, []):
            draw(c, depth + 1)

    for root in children.get("", []):
        draw(root, 0)
    return "\n".join(lines)
