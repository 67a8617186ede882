"""The connector's progressive side, without vLLM: the prefill seals each chunk's blocks
one step after it was scheduled (its forward ran), unseals on preemption and seals
complete when the request finishes; the decode pulls when it admits the request and
cancels the pull when aborted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from support.connector_fakes import FakeClient

from kvd.integrations.connector_core.params import ProgressivePrefill
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.wire import protocol as P


def scheduler(**kw: Any) -> tuple[KvdScheduler, FakeClient]:
    settings = ConnectorSettings(engine_id="eng", address="tcp://127.0.0.1:1", token="",
                                 lease_s=None, consumers=1, pull_timeout_s=60.0,
                                 kv_layout=None, model_name=None, request_timeout_s=1.0)
    sched = KvdScheduler(settings, block_size_tokens=16, **kw)
    client = FakeClient()
    sched._client = client  # type: ignore[assignment]
    sched.peer_address = "tcp://127.0.0.1:7101"
    return sched, client


def output(new: list[tuple[str, list[int], int]] = (),  # type: ignore[assignment]
           cached: list[tuple[str, list[int] | None, int]] = (),  # type: ignore[assignment]
           preempted: set[str] | None = None, resumed: set[str] | None = None) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=n)
                            for r, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=resumed or set(),
            new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
            num_computed_tokens=[n for _, _, n in cached]),
        preempted_req_ids=preempted)


def prefill_request(status: str = "RUNNING") -> Any:
    return SimpleNamespace(request_id="p1", kv_transfer_params={
        "do_remote_decode": True, "kvd_progressive": True, "kvd_transfer_id": "tid-1"},
        status=SimpleNamespace(name=status), num_computed_tokens=60, num_tokens=61)


def seals(client: FakeClient) -> list[tuple[int, list[int], int, bool, bool]]:
    out = [(m.generation, m.block_ids, m.num_tokens, m.complete, m.abort)
           for m in client.sent if isinstance(m, P.Seal)]
    client.sent.clear()
    return out


def test_chunks_are_sealed_a_step_later_unsealed_on_preemption_then_complete() -> None:
    sched, client = scheduler()
    req = prefill_request()
    sched.after_alloc(req, None, 0)
    sched.build_meta(output=output(new=[("p1", [1, 2, 3, 4], 0)]))
    assert seals(client) == []
    sched.build_meta(output=output(cached=[("p1", None, 40)]))  # 40 computed: 2 whole blocks
    assert seals(client) == [(0, [1, 2], 32, False, False)]
    sched.build_meta(output=output(preempted={"p1"}))  # its blocks were freed
    assert seals(client) == [(1, [], 0, False, False)]
    sched.build_meta(output=output(cached=[("p1", [5, 6, 7, 8], 0)], resumed={"p1"}))
    sched.build_meta(output=output(cached=[("p1", None, 48)]))
    assert seals(client) == [(1, [5, 6, 7], 48, False, False)]
    req.status.name = "FINISHED_LENGTH_CAPPED"
    delay, params = sched.request_finished(req, [5, 6, 7, 8])
    assert delay and params == {"kvd_progressive": True, "kvd_transfer_id": "tid-1"}
    assert seals(client) == [(1, [5, 6, 7, 8], 60, True, False)]
    meta = sched.build_meta()
    assert meta.aliases == {"tid-1": "p1"} and "p1" in meta.sent


def test_async_scheduling_seals_one_step_later_still() -> None:
    sched, client = scheduler(async_scheduling=True)
    sched.after_alloc(prefill_request(), None, 0)
    sched.build_meta(output=output(new=[("p1", [1, 2, 3, 4], 0)]))
    sched.build_meta(output=output(cached=[("p1", None, 32)]))
    assert seals(client) == []  # the step that computed them may still run
    sched.build_meta(output=output(cached=[("p1", None, 48)]))
    assert seals(client) == [(0, [1, 2], 32, False, False)]


def test_an_aborted_prefill_aborts_its_seal() -> None:
    sched, client = scheduler()
    req = prefill_request()
    sched.after_alloc(req, None, 0)
    req.status.name = "FINISHED_ABORTED"
    assert sched.request_finished(req, [1]) == (False, None)
    assert seals(client) == [(0, [], 0, False, True)]


def test_the_decode_pulls_when_it_admits_the_request_and_cancels_on_abort() -> None:
    sched, client = scheduler()
    params = ProgressivePrefill("pre", "tid-1", "tcp://10.0.0.1:7101").to_params()
    req = SimpleNamespace(request_id="d1", kv_transfer_params=params, num_prompt_tokens=61,
                          status=SimpleNamespace(name="RUNNING"))
    assert sched.num_new_matched_tokens(req, 0) == (61, True)
    blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None)
                                      for b in (9, 8, 7, 6, 5)]])
    sched.after_alloc(req, blocks, 61)
    meta = sched.build_meta()
    [pull] = client.sent
    assert pull.progressive and pull.remote_block_ids == [] and pull.num_tokens == 61
    assert pull.local_block_ids == [9, 8, 7, 6] and pull.remote_request_id == "tid-1"
    assert pull.remote_engine_id == "pre" and pull.remote_address == "tcp://10.0.0.1:7101"
    assert meta.recv == {"d1": [9, 8, 7, 6]}
    req.status.name = "FINISHED_ABORTED"
    sched.request_finished(req, [9, 8, 7, 6])
    assert isinstance(client.sent[-1], P.CancelPull)


HYBRID = [("mamba", 16), ("attention", 16)]  # vLLM's group order for the tiny Nemotron-H


def test_a_hybrid_prefill_seals_attention_per_chunk_and_the_mamba_state_complete() -> None:
    """The chunks' seals name the attention group's blocks (the Mamba slot, group 0,
    is not final); the complete seal names every group, the Mamba state's slot first."""
    sched, client = scheduler(groups=HYBRID)
    req = prefill_request()
    sched.after_alloc(req, None, 0)
    sched.build_meta(output=SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="p1", block_ids=([70], [1, 2, 3, 4]),
                                            num_computed_tokens=0)],
        scheduled_cached_reqs=None, preempted_req_ids=None))
    sched.build_meta(output=output(cached=[("p1", None, 40)]))
    assert seals(client) == [(0, [1, 2], 32, False, False)]
    req.status.name = "FINISHED_LENGTH_CAPPED"
    delay, params = sched.request_finished_all_groups(req, ([0, 70], [1, 2, 3, 4]))
    assert delay and params == {"kvd_progressive": True, "kvd_transfer_id": "tid-1"}
    [seal] = [m for m in client.sent if isinstance(m, P.Seal)]
    assert seal.complete and seal.num_tokens == 60
    assert seal.group_block_ids == [[70], [1, 2, 3, 4]] and seal.block_ids == [70, 1, 2, 3, 4]


def test_a_hybrid_decode_pulls_every_group_one_prompt_token_short() -> None:
    """The prefill of a Mamba model computes N-1 prompt tokens; the decode's progressive
    pull loads that many, into its blocks of each group (the Mamba state's slot too)."""
    sched, client = scheduler(groups=HYBRID)
    params = ProgressivePrefill("pre", "tid-1", "tcp://10.0.0.1:7101").to_params()
    req = SimpleNamespace(request_id="d1", kv_transfer_params=params, num_prompt_tokens=65,
                          status=SimpleNamespace(name="RUNNING"))
    assert sched.num_new_matched_tokens(req, 0) == (64, True)
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([80], [9, 8, 7, 6, 5]))
    sched.after_alloc(req, blocks, 64)
    meta = sched.build_meta()
    [pull] = client.sent
    assert pull.progressive and pull.num_tokens == 64 and pull.remote_block_ids == []
    assert pull.local_group_block_ids == [[80], [9, 8, 7, 6]]
    assert pull.local_block_ids == [80, 9, 8, 7, 6]
    assert meta.recv == {"d1": [80, 9, 8, 7, 6]}
