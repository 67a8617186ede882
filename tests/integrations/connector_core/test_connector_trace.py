"""The request's trace context through the connector's scheduler half: from the prefill
request (vLLM's trace headers, else kv_transfer_params) into its Publish and the params
it answers with, and from the decode request into its Pull."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from kvd.integrations.connector_core.params import RemotePrefill, parse_remote_prefill
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import ConnectorSettings

ROUTER_TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
VLLM_TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Sent:
    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def send(self, msg: Any, _tag: Any, _now: float) -> bool:
        self.msgs.append(msg)
        return True

    def replies(self) -> list[Any]:
        return []

    def forget_older(self, *_: Any) -> None:
        pass


def _scheduler() -> tuple[KvdScheduler, Sent]:
    settings = ConnectorSettings.from_vllm(SimpleNamespace(
        engine_id="e", kv_connector_extra_config={"kvd_address": "tcp://127.0.0.1:1"}))
    sched = KvdScheduler(settings, 16)
    sched.peer_address, sched.daemon_instance = "tcp://p:7101", "inst"
    sent = Sent()
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
    assert sent.msgs[0].traceparent == ROUTER_TP
    params = json.loads(json.dumps(params))  # as a router copies them
    assert params["traceparent"] == ROUTER_TP
    assert parse_remote_prefill(params).traceparent == ROUTER_TP


def test_vllms_own_trace_header_wins_and_a_bad_one_is_ignored() -> None:
    sched, sent = _scheduler()
    sched.request_finished(_prefill({"do_remote_decode": True, "traceparent": ROUTER_TP},
                                    {"traceparent": VLLM_TP}), [4])
    sched.request_finished(_prefill({"do_remote_decode": True, "traceparent": "garbage"}),
                           [4])
    assert [m.traceparent for m in sent.msgs] == [VLLM_TP, ""]


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
        assert sent.msgs[-1].request_id == rid and sent.msgs[-1].traceparent == want
