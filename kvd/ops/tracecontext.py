"""W3C trace context (``traceparent``) values, without OpenTelemetry: parse, format, start.

What travels with a request (the router's header and ``kv_transfer_params``, Publish and
Pull) is this one string; kvd.ops.otel turns it into spans where tracing is on. This
module imports nothing, so the router and the connector can pass a trace on with tracing
off. https://www.w3.org/TR/trace-context/#traceparent-header (version 00).
"""

from __future__ import annotations

import os
import random
import re

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def sample_ratio() -> float:
    """OTEL_TRACES_SAMPLER_ARG as a ratio in [0, 1] (default 1: every request)."""
    try:
        return min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
    except ValueError:
        return 1.0


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent; None if not one (an
    all-zero id is invalid too)."""
    m = _TRACEPARENT.match(value or "")
    if m is None:
        return None
    trace_id, span_id = int(m.group(1), 16), int(m.group(2), 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(m.group(3), 16) & 1)


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def new_traceparent(ratio: float | None = None) -> str:
    """A fresh trace context (a new trace), sampled at ``ratio`` (default:
    OTEL_TRACES_SAMPLER_ARG) the way TraceIdRatioBased decides, by the trace id's low 64
    bits, so every process that sees it agrees."""
    ratio = sample_ratio() if ratio is None else ratio
    trace_id = random.getrandbits(128) or 1
    span_id = random.getrandbits(64) or 1
    return format_traceparent(trace_id, span_id,
                              (trace_id & (2**64 - 1)) < int(ratio * 2**64))


def traceparent_or_new(value: str | None) -> str:
    """``value`` when it is a valid traceparent (the client's trace goes on), else a new
    trace's."""
    return value if value and parse_traceparent(value) is not None else new_traceparent()
