"""A decode engine waiting only for progressive pulls parks its empty steps longer
(``kvd_progressive_idle_wait_s``), and the KV's arrival still ends the park at once.

Whole engines before this (``test_engine_progressive.py``, a decode whose request waits
for a progressive pull): 155 empty steps a second, each parked 5 ms
(``kvd_idle_wait_s``), 1.0 core taken from the prefill for as long as it computes.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from support.connector_fakes import FakeClient, FakeDaemon

from kvd.integrations.connector_core.completions import EventPump
from kvd.integrations.connector_core.messages import StepAnnouncements
from kvd.integrations.connector_core.params import ProgressivePrefill, RemotePrefill
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import (
    MAX_PROGRESSIVE_IDLE_WAIT_S,
    ConnectorConfigError,
    ConnectorSettings,
)
from kvd.integrations.connector_core.waiting import PullsOut
from kvd.integrations.connector_core.worker import KvdWorker


def _settings(address: str = "tcp://127.0.0.1:1", **kw: Any) -> ConnectorSettings:
    return ConnectorSettings(engine_id="decode-0", address=address, token="", lease_s=None,
                             consumers=1, pull_timeout_s=120.0, kv_layout=None,
                             model_name=None, request_timeout_s=10.0, **kw)


def _from_vllm(**extra: Any) -> ConnectorSettings:
    return ConnectorSettings.from_vllm(SimpleNamespace(
        engine_id="decode-0", kv_connector_extra_config=extra))


def test_the_progressive_park_is_a_setting_bounded_to_half_a_second() -> None:
    assert _from_vllm().progressive_idle_wait_s == 0.05
    assert _from_vllm(kvd_progressive_idle_wait_s=0).progressive_idle_wait_s == 0.0
    assert _from_vllm(kvd_progressive_idle_wait_s=0.2).progressive_idle_wait_s == 0.2
    assert (_from_vllm(kvd_progressive_idle_wait_s=9).progressive_idle_wait_s
            == MAX_PROGRESSIVE_IDLE_WAIT_S == 0.5)
    with pytest.raises(ConnectorConfigError, match="kvd_"):
        _from_vllm(kvd_progressive_idle_wait_s="soon")


def test_pulls_out_says_only_progressive_until_an_ordinary_pull_goes() -> None:
    out = PullsOut()
    assert not out.only_progressive  # nothing out: nothing to park for
    out.sent("d1", progressive=True)
    assert out.only_progressive
    out.sent("d2", progressive=False)
    assert not out.only_progressive
    out.ended(["d2"])
    assert out.only_progressive
    out.ended(["d1", "never-sent"])
    assert not out.only_progressive and len(out) == 0


def _scheduler() -> tuple[KvdScheduler, FakeClient]:
    sched = KvdScheduler(_settings(), block_size_tokens=16)
    client = FakeClient()
    sched._client = client  # type: ignore[assignment]
    sched.peer_address = "tcp://127.0.0.1:7101"
    return sched, client


def _decode(rid: str, params: dict[str, Any]) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=61,
                           status=SimpleNamespace(name="RUNNING"))


def _blocks(*ids: int) -> Any:
    return SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None)
                                    for b in ids]])


def test_the_scheduler_marks_empty_steps_that_wait_only_for_progressive_pulls() -> None:
    sched, _ = _scheduler()
    prog = _decode("d1", ProgressivePrefill("pre", "tid-1", "tcp://10.0.0.1:7101")
                   .to_params())
    assert sched.num_new_matched_tokens(prog, 0) == (61, True)
    sched.after_alloc(prog, _blocks(9, 8, 7, 6, 5), 61)
    assert sched.build_meta(idle=True).only_progressive  # its pull went in this step
    assert sched.build_meta(idle=True).only_progressive
    assert not sched.build_meta(idle=False).only_progressive  # a step that computes
    plain = _decode("d2", RemotePrefill(engine_id="pre", request_id="p2",
                                        address="tcp://10.0.0.1:7101", block_ids=(1, 2, 3, 4),
                                        num_tokens=61, block_size_tokens=16).to_params())
    assert sched.num_new_matched_tokens(plain, 0)[0] == 61
    sched.after_alloc(plain, _blocks(4, 3, 2, 1), 61)
    assert not sched.build_meta(idle=True).only_progressive  # an ordinary pull is out
    sched.on_output(finished_recving={"d2"})
    assert sched.build_meta(idle=True).only_progressive
    sched.on_output(finished_recving={"d1"})  # its KV landed: nothing to wait for
    assert not sched.build_meta(idle=True).only_progressive


def test_an_aborted_progressive_decode_is_no_longer_waited_for() -> None:
    sched, _ = _scheduler()
    prog = _decode("d1", ProgressivePrefill("pre", "tid-1", "tcp://10.0.0.1:7101")
                   .to_params())
    sched.num_new_matched_tokens(prog, 0)
    sched.after_alloc(prog, _blocks(9, 8, 7, 6, 5), 61)
    assert sched.build_meta(idle=True).only_progressive
    prog.status.name = "FINISHED_ABORTED"
    sched.request_finished(prog, [9, 8, 7, 6])
    assert not sched.build_meta(idle=True).only_progressive


def _worker(address: str, **kw: Any) -> KvdWorker:
    geom = SimpleNamespace(tp_rank=0, pp_rank=0)
    worker = KvdWorker(_settings(address, **kw), geom)  # type: ignore[arg-type]
    worker.pump = EventPump(worker.settings, worker.cursor, time.monotonic)
    return worker


def test_the_worker_parks_longer_while_only_progressive_pulls_are_out() -> None:
    daemon = FakeDaemon(delay_s=1.0)  # the prefill is still computing: no event
    worker = _worker(daemon.address, idle_wait_s=0.005, progressive_idle_wait_s=0.2)
    try:
        worker.on_metadata(StepAnnouncements(recv={"r1": [1]}, idle=True,
                                             only_progressive=True))
        assert worker.step_wait_s == 0.2
        t0 = time.monotonic()
        assert worker.step(set()).finished_recving == frozenset()
        assert 0.15 <= time.monotonic() - t0 < 1.0  # one park, not 40 empty steps
        deadline = time.monotonic() + 2
        while not daemon.parked_s and time.monotonic() < deadline:
            time.sleep(0.01)
        assert daemon.parked_s == [0.2]  # the daemon holds the poll as long
        worker.on_metadata(StepAnnouncements(idle=True))  # an ordinary pull's step
        assert worker.step_wait_s == 0.005
        worker.on_metadata(StepAnnouncements(idle=False, only_progressive=False))
        assert worker.step_wait_s == 0.0  # a step that computes never waits
    finally:
        worker.close()
        daemon.close()


def test_the_kv_landing_ends_the_long_park_at_once() -> None:
    daemon = FakeDaemon(delay_s=0.05)  # the last range lands 50 ms into the park
    worker = _worker(daemon.address, progressive_idle_wait_s=0.5)
    try:
        worker.on_metadata(StepAnnouncements(recv={"r1": [1]}, idle=True,
                                             only_progressive=True))
        t0 = time.monotonic()
        report = worker.step(set())
        waited_s = time.monotonic() - t0
        assert report.finished_recving == {"r1"}  # reported in this very step
        assert waited_s < 0.3, f"waited {waited_s:.3f} s: the park was not ended"
    finally:
        worker.close()
        daemon.close()
