"""The request's trace context through the connector's scheduler half: from the prefill
request (vLLM's trace headers, else kv_transfer_params) into its Publish and the params
it answers with, and from the decode request into its Pull."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from support.connector_fakes import FakeClient

from kvd.integrations.connector_core.params import RemotePrefill, parse_remote_prefill
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import ConnectorSettings

ROUTER_TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
VLLM_TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _scheduler() -> tuple[KvdScheduler, FakeClient]:
    settings = ConnectorSettings.from_vllm(SimpleNamespace(
        engine_id="e", kv_connector_extra_config={"kvd_address": "tcp://127.0.0.1:1"}))
    sched = KvdScheduler(settings, 16)
    sched.peer_address, sched.daemon_instance = "tcp://p:7101", "inst"
    sent = FakeClient()
    sched._client = sent  # type: ignore[assignment]
    return sched, sent


def _prefill(params: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return SimpleNamespace(request_id="p-1", kv_transfer_params=params,
                           status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
                           num_computed_tokens=20, num_tokens=21, trace_headers=headers)


def test_publish_and_params_carry_the_routers_trace_context() -> None:
    sched, sent = _scheduler()
    ok, params = sched.request_finished(
        _prefill({"do_remote_decode": True, "traceparent": ROUTER_TP}), [4, 5])
    assert ok and params is not None
    assert sent.sent[0].traceparent == ROUTER_TP
    params = json.loads(json.dumps(params))  # as a router copies them
    assert params["traceparent"] == ROUTER_TP
    assert parse_remote_prefill(params).traceparent == ROUTER_TP


def test_vllms_own_trace_header_wins_and_a_bad_one_is_ignored() -> None:
    sched, sent = _scheduler()
    sched.request_finished(_prefill({"do_remote_decode": True, "traceparent": ROUTER_TP},
                                    {"traceparent": VLLM_TP}), [4])
    sched.request_finished(_prefill({"do_remote_decode": True, "traceparent": "garbage"}),
                           [4])
    assert [m.traceparent for m in sent.sent] == [VLLM_TP, ""]


def test_the_pull_carries_the_decode_requests_trace_context() -> None:
    sched, sent = _scheduler()
    remote = RemotePrefill(engine_id="pre", request_id="p-1", address="tcp://p:7101",
                           block_ids=(4, 5), num_tokens=20, traceparent=ROUTER_TP)
    blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None)
                                      for b in (8, 9)]])
    for rid, headers, want in (("d-1", None, ROUTER_TP),
                               ("d-2", {"traceparent": VLLM_TP}, VLLM_TP)):
        req = SimpleNamespace(request_id=rid, kv_transfer_params=remote.to_params(),
                              num_prompt_tokens=20, trace_headers=headers)
        sched.after_alloc(req, blocks, 20)
        sched.build_meta()
        assert sent.sent[-1].request_id == rid and sent.sent[-1].traceparent == want


def test_with_tracing_on_the_wait_for_the_kv_and_the_first_step_are_spans(monkeypatch) -> None:
    """KVD_OTEL_TRACES=true: the step whose output says the KV landed ends the request's
    wait_kv span, the next step its first_step span, both under its trace context; a
    failed load is an error span and has no first step."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvd.ops import otel

    exporter = InMemorySpanExporter()
    monkeypatch.setenv("KVD_OTEL_TRACES", "true")
    made = otel.RequestSpans
    monkeypatch.setattr(otel, "RequestSpans", lambda service: made(service, exporter))
    sched, _ = _scheduler()
    remote = RemotePrefill(engine_id="pre", request_id="p-1", address="tcp://p:7101",
                           block_ids=(4, 5), num_tokens=20, traceparent=ROUTER_TP)
    blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None)
                                      for b in (8, 9)]])
    for rid in ("d-1", "d-2"):
        sched.after_alloc(SimpleNamespace(request_id=rid, kv_transfer_params=remote.to_params(),
                                          num_prompt_tokens=20, trace_headers=None), blocks, 20)
    sched.build_meta()
    sched.on_output(set(), set())
    assert exporter.get_finished_spans() == ()
    sched.on_output({"d-1", "d-2"}, {"d-2"})
    sched.on_output(set(), set())
    sched.close()
    spans = sorted(exporter.get_finished_spans(), key=lambda s: (s.name, s.attributes[
        "kvd.request_id"]))
    assert [(s.name, s.attributes["kvd.request_id"], s.status.status_code.name)
            for s in spans] == [("kvd.first_step", "d-1", "UNSET"),
                                ("kvd.wait_kv", "d-1", "UNSET"),
                                ("kvd.wait_kv", "d-2", "ERROR")]
    assert all(f"{s.context.trace_id:032x}" == ROUTER_TP[3:35]
               and f"{s.parent.span_id:016x}" == ROUTER_TP[36:52] for s in spans)



def test_decode_scheduled_names_the_scheduler_step(tmp_path, monkeypatch) -> None:
    """The bench groups a batch's requests by the step that scheduled them: requests
    allocated before one build_meta share a step, the next step's have the next."""
    import kvd.integrations.connector_core.scheduler as scheduler_mod
    from kvd.ops.trace import Tracer, read_traces

    monkeypatch.setattr(scheduler_mod, "TRACE", Tracer(str(tmp_path)))
    sched, _sent = _scheduler()
    blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None)
                                      for b in (8, 9)]])

    def admit(rid: str) -> None:
        remote = RemotePrefill(engine_id="pre", request_id=f"p-{rid}",
                               address="tcp://p:7101", block_ids=(4, 5), num_tokens=20)
        sched.after_alloc(SimpleNamespace(request_id=rid, kv_transfer_params=remote.to_params(),
                                          num_prompt_tokens=20, trace_headers=None),
                          blocks, 20)

    sched.build_meta()  # a step with nothing to pull
    admit("d-1")
    admit("d-2")
    sched.build_meta()
    admit("d-3")
    sched.build_meta()
    steps = {rid: value for _ns, point, rid, value in read_traces(str(tmp_path))
             if point == "decode_scheduled"}
    assert steps == {"d-1": 1.0, "d-2": 1.0, "d-3": 2.0}
