"""A step's seals and pulls leave the connector in one ``batch()`` of its client: over
the daemon's direct door that is one write, so the daemon reads the step's requests as
one burst and sends their events together (kvd.daemon.events.AfterBurst)."""

from __future__ import annotations

from types import SimpleNamespace

from support.connector_fakes import FakeClient

from kvd.integrations.connector_core.params import RemotePrefill
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.wire import protocol as P


def test_a_steps_pulls_are_sent_in_one_batch() -> None:
    settings = ConnectorSettings(engine_id="eng", address="tcp://127.0.0.1:1", token="",
                                 lease_s=None, consumers=1, pull_timeout_s=60.0,
                                 kv_layout=None, model_name=None, request_timeout_s=1.0)
    sched = KvdScheduler(settings, block_size_tokens=16)
    client = FakeClient()
    sched._client = client  # type: ignore[assignment]
    for step in range(2):
        for k in range(3):
            rid = f"d{step}-{k}"
            remote = RemotePrefill(engine_id="pre", request_id=f"p-{rid}",
                                   address="tcp://p:7101", block_ids=(4, 5), num_tokens=20)
            blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None)
                                              for b in (8, 9)]])
            sched.after_alloc(SimpleNamespace(request_id=rid, kv_transfer_params=remote.to_params(),
                                              num_prompt_tokens=20, trace_headers=None),
                              blocks, 20)
        sched.build_meta()
    sched.build_meta()  # nothing queued: no batch
    assert [[m.request_id for m in b] for b in client.batches] == [
        ["d0-0", "d0-1", "d0-2"], ["d1-0", "d1-1", "d1-2"]]
    assert all(isinstance(m, P.Pull) for b in client.batches for m in b)
