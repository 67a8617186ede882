"""kvd.ops.tracecontext: W3C traceparent values without OpenTelemetry."""

from __future__ import annotations

from kvd.ops import tracecontext as tc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TP = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_traceparent_helpers() -> None:
    assert tc.parse_traceparent(TP) == (int(TRACE_ID, 16), int(PARENT_ID, 16), True)
    assert tc.parse_traceparent("00-" + "0" * 32 + "-" + PARENT_ID + "-01") is None
    assert tc.new_traceparent(0.0).endswith("-00")
    assert tc.new_traceparent(1.0).endswith("-01")
    tid, sid, sampled = tc.parse_traceparent(tc.new_traceparent(1.0))
    assert tc.format_traceparent(tid, sid, sampled) != TP


def test_a_valid_context_goes_on_and_anything_else_starts_a_new_trace() -> None:
    assert tc.traceparent_or_new(TP) == TP
    for bad in ("", None, "garbage", TP.upper()):
        new = tc.traceparent_or_new(bad)
        assert tc.parse_traceparent(new) is not None and new[3:35] != TRACE_ID
