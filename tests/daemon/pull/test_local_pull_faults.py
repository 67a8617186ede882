"""Local pulls (both engines on one daemon) keep a remote pull's semantics: hybrid
models, a request read by a local and a remote consumer at once, and an engine that
leaves mid-copy. Real ``kvd serve`` processes; bytes checked."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
from support.cluster import deregister_and_check_freed, metric, register, unique
from support.hybrid_cases import CASES as HYBRID_CASES
from support.hybrid_cases import run_hybrid, spec

from kvd.errors import KvdTimeoutError
from kvd.pool.shm import kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

BIG = ModelSpec(name="local-big", num_kv_heads=8, num_layers=32, head_dim=128)  # 2 MiB/block
SMALL = ModelSpec(name="local-fanout", num_kv_heads=4, num_layers=4, head_dim=32)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess.start(unique("itone"), tmp_path_factory.mktemp("kvd-logs"))
    c = d.client()
    try:
        yield d, c
    finally:
        c.close()
        rc = d.stop()
        leftovers = kvd_segments(f"kvd-{d.name}")
        assert rc == 0 and not leftovers, (rc, leftovers)


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_hybrid_local_pull_is_byte_exact(one, case: str) -> None:
    d, c = one
    pshape, dshape, tokens, skip = HYBRID_CASES[case]
    same = SimpleNamespace(pc=c, dc=c, prefill=d)
    before = metric(d, "kvd_transfers_total", role="consumer", path="local")
    recv, sent, bad = run_hybrid(same, spec(), pshape, dshape, tokens, skip)
    assert recv.ok, recv.error
    assert bad == 0, f"{bad} decode elements differ from the expected pools"
    assert sent.ok, sent.error
    assert metric(d, "kvd_transfers_total", role="consumer", path="local") == before + 1


def test_a_local_and_a_remote_consumer_read_one_request(one, tmp_path) -> None:
    """consumers=2: one decode engine on the producer's own daemon (local copy), one on
    another daemon (NIXL READ); the hold ends once both are done, counting both."""
    d, c = one
    other = DaemonProcess.start(unique("itoth"), tmp_path)
    pshape = EngineShape(tp_size=2, num_blocks=16)
    shapes = {"local": EngineShape(tp_size=1, num_blocks=16),
              "remote": EngineShape(tp_size=4, num_blocks=16)}
    g = global_kv(SMALL, 6 * 16)
    p_ids, d_ids = [0, 2, 4, 6, 8, 10], [15, 14, 13, 12, 11, 10]
    pid, rid = unique("fp"), unique("freq")
    try:
        with other.client() as oc:
            prod = [c.register(pid, SMALL, layout_spec(pshape), t, 2) for t in range(2)]
            for r in prod:
                write_shard(r.kv, g, SMALL, pshape, r.tp_rank, 0, p_ids)
            c.publish(pid, rid, p_ids, consumers=2)
            events = {}
            for name, client in (("local", c), ("remote", oc)):
                shape, eid = shapes[name], unique(name)
                ranks = [client.register(eid, SMALL, layout_spec(shape), t, shape.tp_size)
                         for t in range(shape.tp_size)]
                client.pull(eid, rid, pid, d.peer_address, p_ids, d_ids)
                ev = events[name] = client.wait(eid, rid, "done_recving", timeout_s=30)
                assert ev.ok, ev.error
                for r in ranks:
                    assert check_shard(r.kv, g, SMALL, shape, r.tp_rank, 0, d_ids) == 0
                if name == "local":  # one consumer done of two: the blocks stay held
                    with pytest.raises(KvdTimeoutError):
                        c.wait(pid, rid, "done_sending", timeout_s=0.5)
                for r in ranks:
                    client.deregister(r)
            sent = c.wait(pid, rid, "done_sending", timeout_s=10)
            assert sent.ok and sent.nbytes == events["local"].nbytes + events["remote"].nbytes
            paths = {p.request_id: p.path for p in c.status().finished_pulls}
            assert paths[rid] == "local"
            assert [p.path for p in oc.status().finished_pulls if p.request_id == rid] == [
                "remote"]
            for r in prod:
                c.deregister(r)
    finally:
        other.stop()


def _big_pair(c, blocks: int = 96):
    shape = EngineShape(tp_size=1, num_blocks=blocks)
    p = register(c, "bigp", BIG, shape)
    dd = register(c, "bigd", BIG, shape)
    words = p.ranks[0].kv.view(np.uint64).reshape(-1)
    words[:] = np.arange(words.size, dtype=np.uint64)
    rng = random.Random(7)
    return shape, p, dd, rng.sample(range(blocks), blocks), rng.sample(range(blocks), blocks)


@pytest.mark.parametrize("leaving", ["consumer", "producer"])
def test_an_engine_leaving_mid_copy_loses_nothing_and_leaks_nothing(one, leaving) -> None:
    """A 192 MiB local pull; right after the daemon accepted it, one engine deregisters.
    The copy ends safely (its pools stay pinned until it has), the other engine hears a
    clean outcome (ok with the right bytes, or a failure naming every block), and every
    pool is freed once both engines are gone."""
    d, c = one
    shape, p, dd, p_ids, d_ids = _big_pair(c)
    rid = unique("leave")
    expected = p.ranks[0].kv[:, :, p_ids].copy()  # the producer's mapping goes with it
    c.publish(p.engine_id, rid, p_ids)
    c.pull(dd.engine_id, rid, p.engine_id, d.peer_address, p_ids, d_ids)
    leaver, stayer = (dd, p) if leaving == "consumer" else (p, dd)
    for r in leaver.ranks:
        c.deregister(r)
    if leaving == "consumer":  # the producer's hold ends: read in full or given up
        sent = c.wait(p.engine_id, rid, "done_sending", timeout_s=30)
        assert sent.ok or sent.error, sent
    else:  # the consumer's pull: right bytes, or every block reported invalid
        recv = c.wait(dd.engine_id, rid, "done_recving", timeout_s=30)
        if recv.ok:
            assert np.array_equal(dd.ranks[0].kv[:, :, d_ids], expected)
        else:
            assert recv.invalid_block_ids == d_ids and recv.nbytes == 0
    deregister_and_check_freed(c, stayer)
    deadline = time.monotonic() + 10
    while c.status().engines and time.monotonic() < deadline:
        time.sleep(0.05)
    st = c.status()
    assert st.engines == [] and st.pulls == [] and st.held == []


def test_a_frozen_daemon_finishes_its_local_copy_after_the_thaw(one) -> None:
    """SIGSTOP the one daemon right after it accepted a 192 MiB local pull, for five
    times the hold's lease: on SIGCONT the lease moves on by the frozen time (it must not
    expire under the copy), the copy ends and the pull is ok with the right bytes."""
    import os
    import signal

    d, c = one
    shape, p, dd, p_ids, d_ids = _big_pair(c)
    rid = unique("freeze")
    expired0 = metric(d, "kvd_leases_expired_total")
    c.publish(p.engine_id, rid, p_ids, lease_s=1.0)
    c.pull(dd.engine_id, rid, p.engine_id, d.peer_address, p_ids, d_ids)
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(5.0)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    recv = c.wait(dd.engine_id, rid, "done_recving", timeout_s=30)
    assert recv.ok, recv.error
    assert np.array_equal(dd.ranks[0].kv[:, :, d_ids], p.ranks[0].kv[:, :, p_ids])
    assert c.wait(p.engine_id, rid, "done_sending", timeout_s=10).ok
    assert metric(d, "kvd_leases_expired_total") == expired0
    deregister_and_check_freed(c, p, dd)
