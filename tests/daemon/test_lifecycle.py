"""Crashes and restarts of engines and daemons; resources balance to zero at shutdown."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvd.errors import KvdError
from kvd.pool.shm import kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="life", num_kv_heads=4, num_layers=8, head_dim=64)
BIG = EngineShape(tp_size=1, num_blocks=512)  # 64 KiB per block-layer-kv: 32 MiB per request


def _wait_until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_clean_stop_balances_registrations_and_shm(tmp_path):
    # file-backed pools on every host (auto would take memfd huge pages where reserved,
    # which leave no file to count)
    shm = ["--set", "pool_backing=shm"]
    prefill = DaemonProcess.start("lbp", tmp_path, extra_args=shm)
    decode = DaemonProcess.start("lbd", tmp_path, extra_args=shm)
    g = global_kv(MODEL, 64 * 16)
    ids = list(range(64))
    with prefill.client() as pc, decode.client() as dc:
        pr = pc.register("p", MODEL, layout_spec(BIG))
        dr = dc.register("d", MODEL, layout_spec(BIG))
        write_shard(pr.kv, g, MODEL, BIG, 0, 0, ids)
        for i in range(3):
            pc.publish("p", f"r{i}", ids)
            dc.pull("d", f"r{i}", "p", prefill.peer_address, ids, ids[::-1])
            assert dc.wait("d", f"r{i}", "done_recving", timeout_s=30).ok
        assert check_shard(dr.kv, g, MODEL, BIG, 0, 0, ids[::-1]) == 0
        assert kvd_segments("kvd-lbp") and kvd_segments("kvd-lbd")
    for d in (prefill, decode):
        assert d.stop() == 0
        log = d.log_path.read_text()
        assert "shutdown balance: registrations=0 transfers=0" in log, log[-1500:]
    assert kvd_segments("kvd-lbp") == [] and kvd_segments("kvd-lbd") == []


def test_producer_engine_gone_during_read_never_corrupts(tmp_path):
    prefill = DaemonProcess.start("pgp", tmp_path)
    decode = DaemonProcess.start("pgd", tmp_path)
    g = global_kv(MODEL, 256 * 16)
    ids = list(range(256))
    try:
        with prefill.client() as pc, decode.client() as dc:
            pr = pc.register("p", MODEL, layout_spec(BIG))
            dr = dc.register("d", MODEL, layout_spec(BIG))
            write_shard(pr.kv, g, MODEL, BIG, 0, 0, ids)
            outcomes = []
            for i in range(4):
                pc.publish("p", f"r{i}", ids)
            # Warm the handshake, then race deregistration against a pull.
            dc.pull("d", "r0", "p", prefill.peer_address, ids, ids)
            assert dc.wait("d", "r0", "done_recving", timeout_s=30).ok
            dc.pull("d", "r1", "p", prefill.peer_address, ids, ids)
            pc.deregister(pr)
            ev = dc.wait("d", "r1", "done_recving", timeout_s=30)
            outcomes.append(ev.ok)
            if ev.ok:  # read finished before the pool could go: bytes must be exact
                assert check_shard(dr.kv, g, MODEL, BIG, 0, 0, ids) == 0
            else:
                assert ev.invalid_block_ids == ids
            # Requests never acquired were released with the engine.
            dc.pull("d", "r2", "p", prefill.peer_address, ids, ids)
            ev2 = dc.wait("d", "r2", "done_recving", timeout_s=30)
            assert not ev2.ok and ev2.invalid_block_ids == ids
            # The producer's pool is freed once nothing pins it.
            assert _wait_until(lambda: kvd_segments("kvd-pgp") == [])
    finally:
        prefill.stop()
        decode.stop()


def test_daemon_restart_makes_engines_reregister(tmp_path):
    first = DaemonProcess.start("rst1", tmp_path, extra_args=["--set", "heartbeat_interval_s=0.5"])
    lost = threading.Event()
    with first.client(ping_interval_s=0.2, on_lost=lambda msg: lost.set()) as c:
        c.register("e", MODEL, layout_spec(BIG))
        first.stop(signal.SIGKILL)
        second = DaemonProcess.start("rst2", tmp_path, engine_address=first.engine_address,
                                     peer_address=first.peer_address,
                                     extra_args=["--set", "drain_timeout_s=1"])
        try:
            assert lost.wait(10), "the client never noticed the restart"
            with pytest.raises(KvdError, match="not registered"):
                c.publish("e", "r", [1])
            c.register("e", MODEL, layout_spec(BIG))
            c.publish("e", "r", [1])
        finally:
            second.stop()
    # SIGKILL leaves the first daemon's segments behind; the operator's cleanup is
    # `rm /dev/shm/<prefix>-<pid>-*` (docs/operations.md).
    for name in kvd_segments("kvd-rst1"):
        os.unlink(f"/dev/shm/{name}")


def test_consumer_engine_gone_mid_pull_keeps_pool_until_reads_end(tmp_path):
    prefill = DaemonProcess.start("cgp", tmp_path)
    decode = DaemonProcess.start("cgd", tmp_path)
    g = global_kv(MODEL, 512 * 16)
    ids = list(range(512))
    try:
        with prefill.client() as pc, decode.client() as dc:
            pr = pc.register("p", MODEL, layout_spec(BIG))
            dr = dc.register("d", MODEL, layout_spec(BIG))
            write_shard(pr.kv, g, MODEL, BIG, 0, 0, ids)
            pc.publish("p", "warm", ids[:1])
            dc.pull("d", "warm", "p", prefill.peer_address, ids[:1], ids[:1])
            assert dc.wait("d", "warm", "done_recving", timeout_s=30).ok
            # Short lease: if the engine left before the READs were posted, only the
            # lease releases the producer (the consumer acquired it, then gave up).
            pc.publish("p", "big", ids, lease_s=2)
            dc.pull("d", "big", "p", prefill.peer_address, ids, ids)
            dc.deregister(dr)  # the engine crashes while its READs may be running
            st = dc.status()
            rank = [e for e in st.engines if e.engine_id == "d"]
            # Either the pull still pins the retired pool, or it had already finished.
            assert all(e.gone for e in rank)
            assert _wait_until(lambda: not dc.status().pulls, 30)
            assert _wait_until(lambda: kvd_segments("kvd-cgd") == [], 10)
            # The producer saw the reads finish (or the lease bound it): nothing stays held.
            assert pc.wait("p", "big", "done_sending", timeout_s=30).request_id == "big"
            assert decode.proc.poll() is None
    finally:
        prefill.stop()
        decode.stop()
