"""kvd.ops.otel: off, nothing of OpenTelemetry is loaded; on, one hold span on the producer
daemon and one pull span (with its phases) on the consumer daemon, both in the request's
trace under the parent its traceparent names, exported over OTLP/HTTP from two processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvd.wire import protocol as P

TESTS = Path(__file__).resolve().parent.parent
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TP = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_off_a_traced_pull_loads_nothing_of_opentelemetry() -> None:
    """A daemon with otel_traces off (the default) serves a pull that carries a
    traceparent without importing kvd.ops.otel or opentelemetry (fresh interpreter)."""
    code = f"""
import asyncio, sys
from support.inprocess import daemon_pair, register, wait_event

async def main():
    async with daemon_pair() as p:
        await register(p.pc, "pre")
        await register(p.dc, "dec")
        await p.pc.publish("pre", "r1", [0, 1], traceparent={TP!r})
        await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [0, 1], [2, 3],
                        traceparent={TP!r})
        ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
        assert ev.ok, ev
        await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")

asyncio.run(main())
print(sorted(m for m in sys.modules if m.startswith("opentelemetry") or m == "kvd.ops.otel"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=TESTS, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# ---------------------------------------------------------------- on (needs kvd[otel])


def test_pull_spans_in_process_name_every_phase_and_fail_with_the_reason(monkeypatch) -> None:
    """In-process pair, in-memory exporter: an ok pull's phases (cached handshake on the
    second pull: its acquire says so), a failed pull's error span and code."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from support.inprocess import daemon_pair, register, run, wait_event

    from kvd.daemon import server
    from kvd.ops import otel

    exporter = InMemorySpanExporter()
    made: list[otel.Spans] = []

    def spans(cfg, metrics, daemon_id, instance_id):  # noqa: ANN001, ANN202
        out = otel.Spans(metrics, exporter=exporter, attributes={"kvd.daemon_id": daemon_id})
        made.append(out)
        return out

    monkeypatch.setattr(server, "_spans", spans)

    async def body() -> None:
        async with daemon_pair(otel_traces=True) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            for rid in ("r1", "r2"):
                await p.pc.publish("pre", rid, [0, 1], traceparent=TP)
                await p.dc.pull("dec", rid, "pre", p.prefill.cfg.peer_address, [0, 1],
                                [2, 3], traceparent=TP)
                assert (await wait_event(p.dc, p.clock, "dec", rid, "done_recving")).ok
                assert (await wait_event(p.pc, p.clock, "pre", rid, "done_sending")).ok
            await p.dc.pull("dec", "nope", "pre", p.prefill.cfg.peer_address, [0], [4])
            assert not (await wait_event(p.dc, p.clock, "dec", "nope", "done_recving")).ok
            for s in made:
                s.flush()

    run(body())
    got = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in got}
    pulls = [s for s in got if s.name == "kvd.pull"]
    holds = [s for s in got if s.name == "kvd.hold"]
    assert len(pulls) == 3 and len(holds) == 2
    for s in holds + pulls[:2]:
        assert f"{s.context.trace_id:032x}" == TRACE_ID
        assert f"{s.parent.span_id:016x}" == PARENT_ID and s.parent.is_remote
    ok = pulls[1]
    assert ok.attributes["kvd.request_id"] == "r2" and ok.attributes["kvd.outcome"] == "ok"
    assert ok.attributes["kvd.bytes"] > 0 and ok.attributes["kvd.descriptors"] > 0
    children = [s for s in got if s.parent is not None and s.parent.span_id == ok.context.span_id]
    names = sorted(s.name for s in children)
    assert {"kvd.acquire", "kvd.assemble", "kvd.read", "kvd.post",
            "kvd.report"} <= set(names), names
    acquire = next(s for s in children if s.name == "kvd.acquire")
    assert acquire.attributes["kvd.handshake"] == "cached"
    first = [s for s in got if s.parent is not None
             and s.parent.span_id == pulls[0].context.span_id]
    assert "kvd.greet" in {s.name for s in first}  # the first pull greeted
    for s in children:
        assert ok.start_time <= s.start_time <= s.end_time <= ok.end_time, s.name
    failed = pulls[2]
    assert failed.status.status_code.name == "ERROR"
    assert failed.attributes["kvd.error_code"] == "not_found"
    assert "never published" in failed.status.description
    assert failed.parent is None  # no traceparent: a trace of its own
    assert any(s.status.status_code.name == "ERROR" for s in by_id.values()
               if s.parent is not None and s.parent.span_id == failed.context.span_id)
    assert list(holds[0].attributes["kvd.readers"]) == ["dec"]


@pytest.mark.nixl
def test_two_daemon_processes_export_one_trace_over_otlp(tmp_path, monkeypatch) -> None:
    """Two `kvd serve` processes with otel_traces on, an OTLP/HTTP receiver: the hold's
    span (prefill daemon) and the pull's (decode daemon) share the request's trace and
    parent; the duration histogram's exemplar names the trace; an unsampled request
    leaves no span."""
    pytest.importorskip("opentelemetry.sdk")
    from support.cluster import (
        deregister_and_check_freed,
        register,
        running_pair,
        unique,
        wait_until,
    )
    from support.otlp_receiver import OtlpReceiver, waterfall

    from kvd.tools.sim import EngineShape

    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    model = P.ModelSpec(name="otel-model", num_kv_heads=4, num_layers=2, head_dim=32)
    shape = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=16)
    unsampled = f"00-{'1' * 32}-{PARENT_ID}-00"
    try:
        with running_pair(tmp_path, ["--set", "otel_traces=true"]) as pair:
            pre = register(pair.pc, "pre", model, shape)
            dec = register(pair.dc, "dec", model, shape)
            for rid, tp in ((unique("r"), TP), (unique("u"), unsampled)):
                pair.pc.publish(pre.engine_id, rid, [0, 1], traceparent=tp)
                pair.dc.pull(dec.engine_id, rid, pre.engine_id, pair.prefill.peer_address,
                             [0, 1], [2, 3], traceparent=tp)
                assert pair.dc.wait(dec.engine_id, rid, "done_recving", timeout_s=20).ok
                assert pair.pc.wait(pre.engine_id, rid, "done_sending", timeout_s=20).ok

            def both() -> bool:
                names = {s.name for s in receiver.snapshot()}
                return {"kvd.hold", "kvd.pull", "kvd.report"} <= names

            wait_until(both, timeout_s=20, what="the spans of both daemons")
            req = urllib.request.Request(
                f"http://127.0.0.1:{pair.decode.metrics_port}/metrics",
                headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            text = urllib.request.urlopen(req, timeout=5).read().decode()  # noqa: S310
            assert f'trace_id="{TRACE_ID}"' in text
            deregister_and_check_freed(pair.pc, pre)
            deregister_and_check_freed(pair.dc, dec)
    finally:
        receiver.close()
    spans = receiver.snapshot()
    print(waterfall(spans))
    assert all(s.trace_id == TRACE_ID for s in spans), {s.trace_id for s in spans}
    hold = next(s for s in spans if s.name == "kvd.hold")
    pull = next(s for s in spans if s.name == "kvd.pull")
    assert hold.parent_id == pull.parent_id == PARENT_ID
    assert hold.resource["kvd.daemon_id"] != pull.resource["kvd.daemon_id"]
    assert hold.attributes["kvd.outcome"] == "ok" and pull.attributes["kvd.outcome"] == "ok"
    assert {s.parent_id for s in spans if s.name not in ("kvd.hold", "kvd.pull")} == {
        pull.span_id}


def test_a_read_striped_over_workers_has_one_span_per_rail() -> None:
    """A READ the posting workers split: its post span has one child per worker's part,
    naming the worker, its rail, and the part's descriptors and bytes."""
    pytest.importorskip("opentelemetry.sdk")
    from types import SimpleNamespace

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvd.ops import otel
    from kvd.transport.base import PostPart, PostTiming

    exporter = InMemorySpanExporter()
    spans = otel.Spans(None, exporter=exporter)
    parts = (PostPart(0, "", 4, 4096), PostPart(1, "mlx5_0", 6, 6144),
             PostPart(2, "mlx5_1", 6, 6144))
    pull = SimpleNamespace(started_s=1.0, finished_s=1.5, path="remote",
                           post_records=[(0.001, 16, [PostTiming(16, 0.0005, 0.0005, parts)])],
                           posts=[SimpleNamespace(peer="agent-p", nbytes=[16384])])
    parent = otel._child(None)
    spans._post_spans(pull, parent, lambda t: int(t * 1e9), [("post", 1.1), ("end", 1.4)])
    spans.flush()
    got = exporter.get_finished_spans()
    (post,) = [s for s in got if s.name == "kvd.post"]
    rails = [s for s in got if s.name == "kvd.rail_read"]
    assert post.attributes["kvd.workers"] == 3
    assert [(s.attributes["kvd.worker"], s.attributes["kvd.rail"], s.attributes["kvd.bytes"])
            for s in rails] == [(0, "", 4096), (1, "mlx5_0", 6144), (2, "mlx5_1", 6144)]
    assert all(s.parent.span_id == post.context.span_id for s in rails)
