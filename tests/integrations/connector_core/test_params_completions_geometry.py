"""The vLLM connector's engine-free logic: params codec, event mapping, geometry checks.

These run in the default suite without vLLM; the connector itself is proven
against the real scheduler and real engines in tests/integrations/vllm (marker ``vllm``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvd.errors import LayoutError
from kvd.integrations.connector_core.events import EventBook, StepReport
from kvd.integrations.connector_core.geometry import LayerView, VllmKvGeometry, check_views
from kvd.integrations.connector_core.params import (
    ParamsError,
    RemotePrefill,
    blocks_to_pull,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvd.wire.protocol import Event

# ---------------------------------------------------------------- params


def _remote() -> RemotePrefill:
    return RemotePrefill(engine_id="prefill-0", request_id="cmpl-1-0", address="tcp://p:7101",
                         block_ids=(7, 3, 9), num_tokens=40)


def test_params_survive_a_json_round_trip_like_a_router_makes() -> None:
    params = json.loads(json.dumps(_remote().to_params()))
    assert wants_remote_prefill(params) and not wants_remote_decode(params)
    assert parse_remote_prefill(params) == _remote()


def test_the_publish_receipt_travels_in_the_params_and_is_optional() -> None:
    remote = RemotePrefill(engine_id="prefill-0", request_id="cmpl-1-0",
                           address="tcp://p:7101", block_ids=(7,), num_tokens=4,
                           receipt="3f2a/17")
    params = json.loads(json.dumps(remote.to_params()))
    assert params["kvd_receipt"] == "3f2a/17"
    assert parse_remote_prefill(params).receipt == "3f2a/17"
    assert "kvd_receipt" not in _remote().to_params()  # an older prefill: none
    assert parse_remote_prefill(_remote().to_params()).receipt == ""


def test_params_accept_vllm_per_group_block_lists() -> None:
    params = _remote().to_params()
    params["remote_block_ids"] = [[7, 3, 9]]
    assert parse_remote_prefill(params).block_ids == (7, 3, 9)


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("kvd_format", None, "kvd_format"),
    ("remote_engine_id", "", "remote_engine_id"),
    ("remote_request_id", 5, "remote_request_id"),
    ("kvd_address", "x" * 300, "kvd_address"),
    ("remote_block_ids", [1, -2], "remote block id"),
    ("remote_block_ids", [1, True], "remote block id"),
    ("remote_block_ids", "1,2", "remote_block_ids"),
    ("remote_num_tokens", -1, "remote_num_tokens"),
    ("kvd_receipt", 17, "kvd_receipt"),
    ("kvd_receipt", "r" * 129, "kvd_receipt"),
])
def test_params_refuse_what_no_kvd_prefill_produced(key: str, value: object,
                                                     needle: str) -> None:
    params = _remote().to_params()
    params[key] = value
    with pytest.raises(ParamsError, match=needle):
        parse_remote_prefill(params)


def test_blocks_to_pull_is_the_prompt_tail_only() -> None:
    # 40 tokens, blocks of 16: 3 blocks; a 16-token local hit leaves 2; a 4th block
    # allocated for the first decoded token is not written.
    assert blocks_to_pull(40, 16, 16, [5, 6, 8]) == [5, 6]
    assert blocks_to_pull(40, 0, 16, [1, 2, 3, 4]) == [1, 2, 3]
    with pytest.raises(ParamsError, match="multiple of the block size"):
        blocks_to_pull(40, 8, 16, [1, 2, 3])
    with pytest.raises(ParamsError, match="cannot hold"):
        blocks_to_pull(40, 0, 16, [1, 2])


# ---------------------------------------------------------------- events


def ev(kind: str, rid: str, ok: bool = True, invalid: list[int] | None = None) -> Event:
    return Event(kind=kind, request_id=rid, ok=ok, invalid_block_ids=invalid or [],
                 nbytes=100 if ok else 0, duration_s=0.01)


def test_send_is_reported_only_after_vllm_finished_it() -> None:
    book = EventBook()
    book.announce_send("r1", deadline_s=100.0)
    book.on_event(ev("done_sending", "r1"))
    assert book.take().finished_sending == frozenset()
    book.vllm_finished({"r1"})
    assert book.take().finished_sending == {"r1"}
    assert book.take().finished_sending == frozenset()  # once


def test_send_event_before_its_announcement_still_reports_once() -> None:
    book = EventBook()
    book.on_event(ev("done_sending", "r1"))
    book.announce_send("r1", deadline_s=100.0)
    assert book.take().finished_sending == frozenset()
    book.vllm_finished({"r1", "unrelated-decode-request"})
    assert book.take().finished_sending == {"r1"}
    assert not book.waiting_on_daemon
    assert not book._finished, "finished ids of requests never published must not pile up"


def test_recv_event_overtaking_its_metadata_waits_for_it() -> None:
    book = EventBook()
    book.on_event(ev("done_recving", "d1"))
    assert book.take().finished_recving == frozenset()
    book.announce_recv("d1", [4, 5], deadline_s=100.0)
    report = book.take()
    assert report.finished_recving == {"d1"} and not report.invalid_block_ids
    assert book.take_totals().nbytes == 100


def test_failed_pull_reports_finished_and_its_blocks_invalid() -> None:
    book = EventBook()
    book.announce_recv("d1", [4, 5], deadline_s=100.0)
    book.on_event(ev("done_recving", "d1", ok=False, invalid=[4, 5]))
    report = book.take()
    assert report.finished_recving == {"d1"}
    assert report.invalid_block_ids == {4, 5}
    assert report.failed_recving == frozenset()


def test_multi_group_models_fail_per_request_not_per_block() -> None:
    book = EventBook(multi_group=True)
    book.announce_recv("d1", [4, 5], deadline_s=100.0)
    book.on_event(ev("done_recving", "d1", ok=False, invalid=[4, 5]))
    report = book.take()
    assert report.finished_recving == {"d1"} and report.failed_recving == {"d1"}
    assert not report.invalid_block_ids


def test_notify_only_pulls_are_invisible_to_vllm_in_either_order() -> None:
    book = EventBook()
    book.announce_quiet("q1")
    book.on_event(ev("done_recving", "q1"))
    book.on_event(ev("done_recving", "q2"))
    book.announce_quiet("q2")
    assert book.take().finished_recving == frozenset()
    assert not book.waiting_on_daemon


def test_refused_submission_fails_at_once() -> None:
    book = EventBook()
    book.announce_failed_submit("d1", [1, 2])
    report = book.take()
    assert report.finished_recving == {"d1"} and report.invalid_block_ids == {1, 2}


def test_a_refusal_after_a_restart_failed_the_pull_is_not_reported_again() -> None:
    """Seen in a whole engine: the pull reached the restarted daemon (ZMQ queued it
    across the restart) and was refused, "not registered", after the restart had
    already failed it; reporting it twice killed vLLM's engine core (it asserts that a
    finished receive belongs to a request waiting for remote KV)."""
    book = EventBook()
    book.announce_recv("d1", [3, 4], deadline_s=10.0)
    book.announce_send("p1", deadline_s=20.0)
    assert sorted(book.daemon_restarted()) == ["d1", "p1"]
    book.vllm_finished({"p1"})
    report = book.take()
    assert report.finished_recving == {"d1"} and report.invalid_block_ids == {3, 4}
    assert report.finished_sending == {"p1"}
    book.pull_refused("d1", [3, 4])
    book.send_refused("p1")
    assert book.take() == StepReport()
    assert not book.waiting_on_daemon
    assert book.totals.pulls_failed == 1 and book.totals.sends_expired == 1


def test_a_refusal_before_anything_else_fails_the_pull_once() -> None:
    book = EventBook()
    book.announce_recv("d1", [3], deadline_s=10.0)
    book.pull_refused("d1", [3])
    assert book.take().finished_recving == {"d1"}
    assert book.daemon_restarted() == []
    assert book.expire(11.0) == []
    assert book.take() == StepReport()


def test_a_daemon_that_never_answers_times_out_both_ways() -> None:
    book = EventBook()
    book.announce_recv("d1", [3], deadline_s=10.0)
    book.announce_send("p1", deadline_s=20.0)
    book.vllm_finished({"p1"})
    assert book.expire(9.0) == []
    assert book.expire(10.0) == ["d1"]
    report = book.take()
    assert report.finished_recving == {"d1"} and report.invalid_block_ids == {3}
    assert book.expire(25.0) == ["p1"]
    assert book.take().finished_sending == {"p1"}
    assert not book.waiting_on_daemon


# ---------------------------------------------------------------- geometry


def _geom(**kw: object) -> VllmKvGeometry:
    base = dict(model_name="tiny", total_kv_heads=4, total_layers=2, heads_on_rank=2,
                layer_names=("l0", "l1"), head_size=8, head_size_v=8, dtype="float16",
                mla=False, block_size_tokens=4, num_blocks=6, kv_layout="LBHNC",
                buf_nbytes=2 * 6 * 2 * 4 * 16 * 2, tp_rank=0, tp_size=2)
    base.update(kw)
    return VllmKvGeometry(**base)  # type: ignore[arg-type]


def _views(geom: VllmKvGeometry, pool: np.ndarray, order: tuple[int, ...] = (0, 1)
           ) -> list[LayerView]:
    """vLLM-style [B, H, N, C] views of an LBHNC pool (as allocate_kv_cache builds them)."""
    layers = pool.view(np.float16).reshape(2, 6, 2, 4, 16)
    return [LayerView(name=geom.layer_names[i], data_ptr=layers[j].ctypes.data,
                      shape=layers[j].shape, strides_nbytes=layers[j].strides)
            for i, j in zip((0, 1), order, strict=True)]


def test_allocation_must_equal_the_pool() -> None:
    _geom().check_allocation()
    with pytest.raises(LayoutError, match="vLLM allocates 10 bytes"):
        _geom(buf_nbytes=10).check_allocation()
    with pytest.raises(LayoutError, match="V head size"):
        _geom(head_size_v=4).check_allocation()
    with pytest.raises(LayoutError, match="not supported"):
        _geom(dtype="int4").check_allocation()


def test_views_inside_the_pool_in_kvd_layout_pass() -> None:
    geom = _geom()
    pool = np.zeros(geom.buf_nbytes, dtype=np.uint8)
    check_views(geom, _views(geom, pool), pool.ctypes.data, pool.nbytes)


def test_views_elsewhere_or_swapped_or_strided_otherwise_fail_naming_the_layer() -> None:
    geom = _geom()
    pool = np.zeros(geom.buf_nbytes, dtype=np.uint8)
    other = np.zeros(geom.buf_nbytes, dtype=np.uint8)
    with pytest.raises(LayoutError, match="outside kvd's pool"):
        check_views(geom, _views(geom, other), pool.ctypes.data, pool.nbytes)
    with pytest.raises(LayoutError, match="layer 'l0' starts at pool offset"):
        check_views(geom, _views(geom, pool, order=(1, 0)), pool.ctypes.data, pool.nbytes)
    nhd = pool.view(np.float16).reshape(2, 6, 4, 2, 16).transpose(0, 1, 3, 2, 4)
    views = [LayerView(name=n, data_ptr=nhd[i].ctypes.data, shape=nhd[i].shape,
                       strides_nbytes=nhd[i].strides) for i, n in enumerate(geom.layer_names)]
    with pytest.raises(LayoutError, match="byte strides"):
        check_views(geom, views, pool.ctypes.data, pool.nbytes)
    with pytest.raises(LayoutError, match=r"no KV view for layers \['l1'\]"):
        check_views(geom, _views(geom, pool)[:1], pool.ctypes.data, pool.nbytes)


def test_prefill_block_size_travels_and_is_checked() -> None:
    remote = RemotePrefill(engine_id="p", request_id="r", address="tcp://p:1", block_ids=(1,),
                           num_tokens=10, block_size_tokens=64)
    params = json.loads(json.dumps(remote.to_params()))
    assert params["kvd_block_size"] == 64
    assert parse_remote_prefill(params) == remote
    for bad in (0, -64, "64", True):
        params["kvd_block_size"] = bad
        with pytest.raises(ParamsError, match="kvd_block_size"):
            parse_remote_prefill(params)
