"""OpenTelemetry spans of kvd, built after the fact from a finished pull's or hold's record.

Imported only when tracing is on (the daemon's ``otel_traces``, ``kvd router --otel``):
with it off nothing of OpenTelemetry is loaded (tests/test_layers.py). Nothing here runs
inside a pull: the pull keeps its phases' times in its own record (``Pull.marks``, set
only for a traced daemon), and the consumer makes ONE call when the pull is reported
(`Spans.pull_ended`), the producer one when a hold ends (`Spans.hold_ended`). That call
decides sampling, notes the trace id for the duration histogram's exemplar, and queues
the record; a thread of its own builds the spans from it (OpenTelemetry's SDK: a span
costs microseconds of Python) and hands them to the SDK's batch exporter.

The spans, all in the request's own trace when its Publish or Pull carried a W3C
``traceparent`` (the router's, or the client's), else in a trace of their own:

* ``kvd.hold`` (producer daemon): publish until the hold ended (every consumer read it,
  lease expired, released), with its consumers;
* ``kvd.pull`` (consumer daemon): the Pull's arrival until it was reported; children
  ``kvd.wait_ranks``, ``kvd.greet`` (a handshake: not there when cached),
  ``kvd.acquire`` (the Acquire until every reply), ``kvd.assemble``,
  ``kvd.read`` (first post until every transfer ended) with one ``kvd.post``
  per READ or copy posted (its producer, descriptors, bytes, build and transfer time),
  ``kvd.quarantine``, ``kvd.report`` (released until the engine was answered),
  and the ``notice`` event (READ notices sent to the producers).

In the decode engine's process (KVD_OTEL_TRACES=true there, the connector's scheduler
half: kvd.integrations.connector_core.scheduler): ``kvd.wait_kv``, from the
blocks allocated for the remote KV until the step whose output says it landed (an error
span when the load failed), and ``kvd.first_step``, the step after, in which
the request computes on its KV. ``kvd router --otel``: ``kvd.router``, the whole request,
the parent of every other span (vLLM's own ``llm_request`` spans included).

A failed pull or hold is an error span whose status says why (the pull's error, its
code in ``kvd.error_code``), on the span of the phase it failed in as well.

Configured the OpenTelemetry way: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; OTLP/HTTP protobuf), ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``; sampling: a request's own decision (its traceparent's
sampled flag) is followed; a request without one is sampled at
``OTEL_TRACES_SAMPLER_ARG`` (a ratio, default 1).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from kvd.ops.tracecontext import format_traceparent, parse_traceparent, sample_ratio

log = logging.getLogger("kvd.otel")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)

MAX_QUEUED = 65_536  # records waiting for the span thread; past it new ones are dropped
FLUSH_S = 0.5  # how often the span thread turns records into spans


def _context(traceparent: str) -> Any:
    """The OpenTelemetry context a span joins: the remote parent a traceparent names, or
    None (a root)."""
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return None
    trace_id, span_id, sampled = parsed
    parent = SpanContext(trace_id, span_id, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else 0))
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _remote(traceparent: str) -> SpanContext | None:
    """The remote parent a traceparent names; None: a root."""
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return None
    return SpanContext(parsed[0], parsed[1], is_remote=True, trace_flags=_SAMPLED)


def _child(parent: SpanContext | None) -> SpanContext:
    """A new span's context: in ``parent``'s trace, or a new trace."""
    trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
    return SpanContext(trace_id, random.getrandbits(64) or 1, is_remote=False,
                       trace_flags=_SAMPLED)


def provider(service: str, exporter: SpanExporter | None = None,
             attributes: dict[str, str] | None = None, sampler: Any = ALWAYS_ON
             ) -> TracerProvider:
    """A tracer provider for ``service`` exporting in batches (OTLP/HTTP unless
    ``exporter`` is given; the OTEL_EXPORTER_OTLP_* variables configure it). The daemon
    decides sampling before it makes spans (`Spans`): its provider keeps every span."""
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service),
                                **(attributes or {})})
    out = TracerProvider(resource=resource, sampler=sampler)
    out.add_span_processor(BatchSpanProcessor(exporter))
    return out


class RequestSpans:
    """Spans made as a request goes, for ``kvd router``: one per request, whose context
    is the traceparent it sends on to both engines. Sampled like OpenTelemetry's default
    with a ratio: the client's decision when it sent a traceparent, else
    OTEL_TRACES_SAMPLER_ARG of the new traces."""

    def __init__(self, service: str = "kvd-router", exporter: SpanExporter | None = None
                 ) -> None:
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self.provider = provider(service, exporter,
                                 sampler=ParentBased(TraceIdRatioBased(sample_ratio())))
        self.tracer = self.provider.get_tracer("kvd")

    def start(self, name: str, traceparent: str, attributes: dict[str, Any]
              ) -> tuple[Any, str]:
        """The span (a child of ``traceparent`` when valid, else a new trace's root) and
        the traceparent naming it."""
        span = self.tracer.start_span(name, context=_context(traceparent),
                                      kind=SpanKind.SERVER, attributes=attributes)
        ctx = span.get_span_context()
        return span, format_traceparent(ctx.trace_id, ctx.span_id, ctx.trace_flags.sampled)

    def record(self, name: str, traceparent: str, start_ns: int, end_ns: int,
               attributes: dict[str, Any], error: str = "") -> None:
        """A span that already ended (Unix nanoseconds), a child of ``traceparent``."""
        span = self.tracer.start_span(name, context=_context(traceparent),
                                      start_time=start_ns, attributes=attributes)
        self.end(span, error, end_ns=max(start_ns, end_ns))

    @staticmethod
    def end(span: Any, error: str = "", attributes: dict[str, Any] | None = None,
            end_ns: int | None = None) -> None:
        if attributes:
            span.set_attributes(attributes)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()


class Spans:
    """The daemon's spans: one call when a pull is reported, one when a hold ends."""

    def __init__(self, metrics: Any = None, service: str = "kvd",
                 exporter: SpanExporter | None = None,
                 attributes: dict[str, str] | None = None, ratio: float | None = None) -> None:
        self.metrics = metrics  # kvd.ops.metrics.Metrics: gets each sampled trace id
        self.ratio = sample_ratio() if ratio is None else ratio
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        # Finished spans are made directly (ReadableSpan, ~2 us each) and handed to the
        # batch processor: the tracer API's live spans cost ~6x more, for nothing here.
        self.resource = Resource.create({
            "service.name": os.environ.get("OTEL_SERVICE_NAME", service),
            **(attributes or {})})
        self._scope = InstrumentationScope("kvd")
        self.processor = BatchSpanProcessor(exporter)
        self.dropped = 0
        self._queue: collections.deque[tuple[str, Any, Any, float, int]] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvd-otel", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ on the loop

    def _sampled(self, traceparent: str) -> bool:
        """The request's own decision (its flag), else the ratio; cheap (a regex at most)."""
        if traceparent:
            parsed = parse_traceparent(traceparent)
            if parsed is not None:
                if parsed[2] and self.metrics is not None:
                    self.metrics.exemplar = {"trace_id": f"{parsed[0]:032x}"}
                return parsed[2]
        return self.ratio >= 1.0 or random.random() < self.ratio

    def _queue_up(self, kind: str, record: Any, extra: Any, now_s: float) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        # The record's times are on the daemon's monotonic clock: this maps them to the
        # wall clock (a span's times are Unix nanoseconds).
        self._queue.append((kind, record, extra, now_s, time.time_ns()))

    def pull_ended(self, pull: Any, now_s: float) -> None:
        """A pull (kvd.daemon.pull.machine.Pull) was reported: its spans, later."""
        if self._sampled(pull.msg.traceparent):
            self._queue_up("pull", pull, None, now_s)

    def hold_ended(self, held: Any, outcome: str, now_s: float) -> None:
        """A hold (kvd.daemon.produce.held.HeldRequest) ended with ``outcome``."""
        if self._sampled(held.traceparent):
            self._queue_up("hold", held, outcome, now_s)

    # ------------------------------------------------------------ the span thread

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        while self._queue:
            kind, record, extra, now_s, wall_ns = self._queue.popleft()
            try:
                if kind == "pull":
                    self._pull_spans(record, now_s, wall_ns)
                else:
                    self._hold_span(record, extra, now_s, wall_ns)
            except Exception:  # noqa: BLE001 - a span never takes anything down
                log.exception("building the spans of a %s failed", kind)
            # Hand the GIL over between records: the daemon's loop, waiting for it to
            # serve a request, gets it within one record's spans, not a switch interval.
            time.sleep(0)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Every record queued so far made into spans and exported."""
        self._drain()
        self.processor.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(5.0)
        self._drain()
        self.processor.shutdown()

    # ------------------------------------------------------------ building

    def _emit(self, name: str, ctx: SpanContext, parent: SpanContext | None,
              start_ns: int, end_ns: int, attributes: dict[str, Any], error: str = "",
              kind: SpanKind = SpanKind.INTERNAL, events: tuple[Event, ...] = ()) -> None:
        status = Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET)
        self.processor.on_end(ReadableSpan(
            name, context=ctx, parent=parent, resource=self.resource, attributes=attributes,
            events=events, kind=kind, instrumentation_scope=self._scope, status=status,
            start_time=start_ns, end_time=max(start_ns, end_ns)))

    def _span(self, name: str, parent: SpanContext | None, start_ns: int, end_ns: int,
              attributes: dict[str, Any], error: str = "",
              kind: SpanKind = SpanKind.INTERNAL) -> SpanContext:
        ctx = _child(parent)
        self._emit(name, ctx, parent, start_ns, end_ns, attributes, error, kind)
        return ctx

    def _hold_span(self, held: Any, outcome: str, now_s: float, wall_ns: int) -> None:
        def ns(t: float) -> int:
            return wall_ns - int((now_s - t) * 1e9)

        error = "" if outcome == "ok" else f"hold ended {outcome}"
        attrs = {"kvd.request_id": held.request_id, "kvd.engine_id": held.engine_id,
                 "kvd.hold_id": held.hold_id, "kvd.outcome": outcome,
                 "kvd.blocks": len(held.block_ids), "kvd.bytes": held.nbytes,
                 "kvd.consumers": held.consumers,
                 "kvd.consumers_done": len(held.consumers_done),
                 "kvd.readers": sorted(held.readers),
                 "kvd.abandoned": sorted(held.abandoned)}
        self._span("kvd.hold", _remote(held.traceparent), ns(held.published_s), wall_ns,
                   attrs, error, SpanKind.SERVER)

    def _pull_spans(self, pull: Any, now_s: float, wall_ns: int) -> None:
        def ns(t: float) -> int:
            return wall_ns - int((now_s - t) * 1e9)

        msg = pull.msg
        code = pull.error.split(":", 1)[0] if pull.error else ""
        remote = pull.remote
        attrs: dict[str, Any] = {
            "kvd.request_id": msg.request_id, "kvd.engine_id": msg.engine_id,
            "kvd.remote_engine_id": msg.remote_engine_id,
            "kvd.remote_request_id": msg.producer_request_id,
            "kvd.peer": msg.remote_address, "kvd.path": pull.path,
            "kvd.outcome": pull.outcome, "kvd.bytes": pull.nbytes,
            "kvd.descriptors": pull.descriptors, "kvd.blocks": len(msg.local_block_ids),
            "kvd.posts": len(pull.post_records)}
        if remote is not None:
            attrs["kvd.producer_daemons"] = sorted(remote.daemons)
        if code:
            attrs["kvd.error_code"] = code
        parent = _remote(msg.traceparent)
        ctx = _child(parent)  # the pull's span: its phases' parent
        marks = pull.marks or []
        failed = pull.outcome != "ok"
        for name, start, end, ended_by, phase_attrs in _phases(marks, now_s):
            # The phase the pull ended in carries its error too.
            error = pull.error if failed and ended_by == "end" else ""
            if name == "read" and pull.post_records:  # from the first post's call
                start = max(pull.started_s, start - pull.post_records[0][0])
            self._span(f"kvd.{name}", ctx, ns(start), ns(end), phase_attrs, error)
        read = _first(marks, "post")
        if read is not None:
            self._post_spans(pull, ctx, ns, marks)
        events: tuple[Event, ...] = ()
        if pull.outcome == "ok" and pull.notices:
            events = (Event("notice", {"kvd.notices": len(pull.notices)}, wall_ns),)
        self._emit("kvd.pull", ctx, parent, ns(pull.started_s), wall_ns, attrs, pull.error,
                   SpanKind.SERVER, events)

    def _post_spans(self, pull: Any, ctx: Any, ns: Any, marks: list[tuple[str, float]]
                    ) -> None:
        """One span per READ (or copy) posted: from its post until the read phase ended."""
        posted = [t for name, t in marks if name == "post"]
        end = _first(marks, "end") or pull.finished_s
        for i, (post_s, descriptors, timings) in enumerate(pull.post_records):
            done = posted[i] if i < len(posted) else end
            # The mark is taken once the post call returned (post_s: how long it took).
            start = max(pull.started_s, done - post_s)
            for j, timing in enumerate(timings):
                post = pull.posts[j] if j < len(pull.posts) else None
                attrs: dict[str, Any] = {"kvd.attempt": i, "kvd.read": j,
                                         "kvd.descriptors": getattr(timing, "descriptors",
                                                                    descriptors),
                                         "kvd.path": pull.path}
                if post is not None:
                    attrs["kvd.producer_agent"] = post.peer
                    attrs["kvd.bytes"] = int(sum(post.nbytes))
                if timing is not None:
                    attrs["kvd.build_s"] = timing.build_s
                    attrs["kvd.transfer_s"] = timing.transfer_s
                parts = getattr(timing, "parts", ())
                if parts:
                    attrs["kvd.workers"] = len(parts)
                post_ctx = self._span("kvd.post", ctx, ns(start), ns(max(end, done)), attrs)
                for part in parts:  # striped over posting workers: one span per rail
                    self._span("kvd.rail_read", post_ctx, ns(start), ns(max(end, done)),
                               {"kvd.worker": part.worker, "kvd.rail": part.rail,
                                "kvd.descriptors": part.descriptors,
                                "kvd.bytes": part.nbytes})


def _first(marks: Iterable[tuple[str, float]], name: str) -> float | None:
    return next((t for n, t in marks if n == name), None)


# Phase spans from a pull's marks: (span, the mark that starts it, the marks that end it).
_PHASES = (
    ("wait_ranks", ("wait_ranks",), ("handshake", "end")),
    ("greet", ("handshake",), ("acquire", "end")),
    ("acquire", ("early_acquire", "acquire"), ("replies", "end")),
    ("assemble", ("early_acquire", "acquire"), ("assembled", "end")),
    ("read", ("post",), ("end",)),
    ("quarantine", ("quarantine",), ("fail",)),
    ("report", ("finish", "fail"), ()),
)


def _phases(marks: list[tuple[str, float]], now_s: float
            ) -> list[tuple[str, float, float, str, dict[str, Any]]]:
    """(phase, start, end, the mark that ended it, attributes) for each phase the marks
    show; a phase entered again (a greeting again) is one span each time. ``now_s``: the
    report (the end of a phase nothing else ended)."""
    out = []
    for name, starts, ends in _PHASES:
        for i, (mark, t) in enumerate(marks):
            if mark not in starts:
                continue
            if name == "read" and any(m == "post" for m, _ in marks[:i]):
                continue  # one read span from the first post (posts again are inside it)
            end, ended_by = next(((t2, m2) for m2, t2 in marks[i + 1:] if m2 in ends),
                                 (now_s, "report"))
            attrs: dict[str, Any] = {}
            if name == "acquire":
                attrs["kvd.handshake"] = "cached" if mark == "early_acquire" else "greeted"
            out.append((name, t, end, ended_by, attrs))
    return out
