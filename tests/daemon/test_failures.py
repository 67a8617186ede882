"""Failure paths between real daemon processes: each ends in a clear, asserted outcome.

Every test checks the outcome (the error, the invalid blocks, the counters) and
that the daemons keep serving: a byte-exact transfer afterwards still works.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from support.cluster import (
    deregister_and_check_freed,
    kill_producer_mid_pulls,
    metric,
    register,
    run_transfer,
    start_daemon,
    stop_and_check_clean,
    unique,
    wait_until,
)
from support.schedstat import run_queue_wait_s

from kvd.errors import IncompatibleError, KvdError
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess, free_port
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire import protocol as P
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="fail-model", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=32)
ENC = msgspec.msgpack.Encoder()
# A dead peer's Acquire fails after this; keeps the kill test short.
DAEMON_ARGS = ["--set", "handshake_timeout_s=2"]


def check_still_serving(pair) -> None:
    """A fresh byte-exact transfer between the module's daemons."""
    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, MODEL, SHAPE, SHAPE, 128)
    assert res.recv.ok, res.recv.error
    assert res.mismatches == 0 and res.stray == 0
    assert res.sent.ok, res.sent.error


@pytest.fixture
def engines(pair):
    """A registered prefill engine and decode engine (TP 1 each), freed afterwards."""
    p = register(pair.pc, "pre", MODEL, SHAPE)
    d = register(pair.dc, "dec", MODEL, SHAPE)
    yield p, d
    deregister_and_check_freed(pair.pc, p)
    deregister_and_check_freed(pair.dc, d)


# ------------------------------------------------------------------ requests the producer lacks


def test_pull_of_never_published_request_fails_with_invalid_blocks(pair, engines) -> None:
    p, d = engines
    local = [3, 7, 11]
    pair.dc.pull(d.engine_id, "never-published", p.engine_id, pair.prefill.peer_address,
                 [1, 2, 3], local)
    ev = pair.dc.wait(d.engine_id, "never-published", "done_recving", timeout_s=10)
    assert not ev.ok
    assert "never published" in ev.error or "not held" in ev.error, ev.error
    assert ev.invalid_block_ids == local
    assert ev.nbytes == 0
    check_still_serving(pair)


def test_pull_after_lease_expired_fails_and_is_counted(pair, engines) -> None:
    p, d = engines
    before = metric(pair.prefill, "kvd_leases_expired_total")
    pair.pc.publish(p.engine_id, "short-lease", [0, 1], lease_s=0.3)
    sent = pair.pc.wait(p.engine_id, "short-lease", "done_sending", timeout_s=5)
    assert not sent.ok and "expired" in sent.error, sent
    pair.dc.pull(d.engine_id, "short-lease", p.engine_id, pair.prefill.peer_address, [0, 1],
                 [5, 6])
    ev = pair.dc.wait(d.engine_id, "short-lease", "done_recving", timeout_s=10)
    assert not ev.ok
    assert ev.invalid_block_ids == [5, 6]
    assert "never published" in ev.error or "no longer held" in ev.error, ev.error
    assert metric(pair.prefill, "kvd_leases_expired_total") >= before + 1
    assert metric(pair.prefill, "kvd_transfers_total", role="producer", outcome="expired") >= 1
    check_still_serving(pair)


def test_block_ids_out_of_range_are_refused_immediately(pair, engines) -> None:
    p, d = engines
    n = SHAPE.num_blocks
    for bad in ([0, n], [-1], [2**40]):
        with pytest.raises(KvdError, match="out of range"):
            pair.pc.publish(p.engine_id, unique("oob"), bad)
        with pytest.raises(KvdError, match="out of range"):
            pair.dc.pull(d.engine_id, unique("oob"), p.engine_id, pair.prefill.peer_address,
                         [0], bad)
    # Remote ids the producer never published (here: beyond its pool) fail the pull itself.
    pair.pc.publish(p.engine_id, "in-range", [0, 1])
    pair.dc.pull(d.engine_id, "in-range", p.engine_id, pair.prefill.peer_address, [0, n + 5],
                 [2, 3])
    ev = pair.dc.wait(d.engine_id, "in-range", "done_recving", timeout_s=10)
    assert not ev.ok and ev.invalid_block_ids == [2, 3]
    assert "not published" in ev.error, ev.error
    assert pair.pc.status().daemon_id and pair.dc.status().daemon_id
    # The producer still holds the request: a correct pull of it succeeds.
    pair.dc.pull(d.engine_id, "in-range-2", p.engine_id, pair.prefill.peer_address, [0, 1],
                 [2, 3])
    ev = pair.dc.wait(d.engine_id, "in-range-2", "done_recving", timeout_s=10)
    assert not ev.ok and "never published" in ev.error  # different request id: not held
    pair.dc.pull(d.engine_id, "in-range", p.engine_id, pair.prefill.peer_address, [0, 1],
                 [2, 3])
    assert pair.dc.wait(d.engine_id, "in-range", "done_recving", timeout_s=10).ok
    assert pair.pc.wait(p.engine_id, "in-range", "done_sending", timeout_s=10).ok


# ------------------------------------------------------------------ geometry


@pytest.mark.parametrize("change", [{"head_dim": 64}, {"name": "other-model"},
                                    {"dtype": "float16"}])
def test_incompatible_geometry_fails_the_pull(pair, change) -> None:
    other = msgspec.structs.replace(MODEL, **change)
    p = register(pair.pc, "pre", MODEL, SHAPE)
    d = register(pair.dc, "dec", other, SHAPE)
    try:
        pair.pc.publish(p.engine_id, "geo", [0, 1])
        pair.dc.pull(d.engine_id, "geo", p.engine_id, pair.prefill.peer_address, [0, 1], [0, 1])
        ev = pair.dc.wait(d.engine_id, "geo", "done_recving", timeout_s=10)
        assert not ev.ok and ev.invalid_block_ids == [0, 1]
        assert "incompatible" in ev.error, ev.error
        assert metric(pair.decode, "kvd_handshakes_total", outcome="refused") >= 1
    finally:
        deregister_and_check_freed(pair.pc, p)
        deregister_and_check_freed(pair.dc, d)
    check_still_serving(pair)


def test_kv_layout_mismatch_is_incompatible(pair) -> None:
    p = register(pair.pc, "pre", MODEL, SHAPE)
    d = register(pair.dc, "dec", MODEL, EngineShape(tp_size=1, num_blocks=32,
                                                    kv_layout="blocks_first"))
    try:
        pair.pc.publish(p.engine_id, "lay", [0])
        pair.dc.pull(d.engine_id, "lay", p.engine_id, pair.prefill.peer_address, [0], [0])
        ev = pair.dc.wait(d.engine_id, "lay", "done_recving", timeout_s=10)
        assert not ev.ok and "incompatible" in ev.error, ev.error
    finally:
        deregister_and_check_freed(pair.pc, p)
        deregister_and_check_freed(pair.dc, d)


def test_second_rank_with_other_geometry_is_refused(pair) -> None:
    eid = unique("mix")
    shape2 = EngineShape(tp_size=2, num_blocks=8)
    lay = layout_spec(shape2)
    r0 = pair.pc.register(eid, MODEL, lay, 0, 2)
    try:
        bad_model = msgspec.structs.replace(MODEL, head_dim=64)
        with pytest.raises(IncompatibleError):
            pair.pc.register(eid, bad_model, lay, 1, 2)
        with pytest.raises(IncompatibleError):
            pair.pc.register(eid, MODEL, layout_spec(EngineShape(tp_size=2, num_blocks=9)), 1, 2)
        with pytest.raises(IncompatibleError):
            pair.pc.register(eid, MODEL, lay, 1, 4)  # another TP size
        with pytest.raises(KvdError, match="already registered"):
            pair.pc.register(eid, MODEL, lay, 0, 2)
        with pytest.raises(KvdError):
            pair.pc.register(eid, MODEL, lay, 2, 2)  # rank outside TP
        ranks = [e for e in pair.pc.status().engines if e.engine_id == eid]
        assert [e.rank for e in ranks] == [r0_key(r0)]
    finally:
        pair.pc.deregister(r0)
    wait_until(lambda: not [e for e in pair.pc.status().engines if e.engine_id == eid])


def r0_key(handle) -> str:
    from kvd.planner import RankId

    return RankId(handle.tp_rank, handle.pp_rank).key


# ------------------------------------------------------------------ protocol


def raw_call(address: str, frames: list[bytes], timeout_s: float = 3.0) -> list[bytes] | None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)


def header(v: int = P.PROTOCOL_VERSION, kind: str = "StatusQuery", msg_id: int = 7) -> bytes:
    return ENC.encode(P.Header(v=v, kind=kind, id=msg_id))


def expect_error(reply: list[bytes] | None, code: str | None = None,
                 msg_id: int | None = None) -> P.Error:
    assert reply is not None, "no reply"
    hdr, body = P.decode(reply, P.REPLIES)
    assert isinstance(body, P.Error), body
    if code is not None:
        assert body.code == code, body
    if msg_id is not None:
        assert hdr.id == msg_id, "the Error must echo the request id so a caller can match it"
    return body


@pytest.mark.parametrize("face", ["engine", "peer"])
def test_protocol_version_mismatch_gets_incompatible(pair, face) -> None:
    d = pair.prefill
    address = d.engine_address if face == "engine" else d.peer_address
    body = ENC.encode(P.StatusQuery() if face == "engine" else
                      P.Heartbeat(producer_engine_id="x", request_ids=[]))
    kind = "StatusQuery" if face == "engine" else "Heartbeat"
    before = metric(d, "kvd_protocol_errors_total", face=face, reason="version")
    err = expect_error(raw_call(address, [header(v=999, kind=kind), body]), "incompatible",
                       msg_id=7)
    assert "999" in err.message
    assert metric(d, "kvd_protocol_errors_total", face=face, reason="version") == before + 1


# (frames, metric reason, id the Error echoes: 7 where the header decodes, else 0)
BAD_MESSAGES = {
    "garbage-header": ([b"\xc1\xc1", b"\x80"], "decode", 0),
    # The id is echoed wherever it can be read, even from a header that does not decode.
    "truncated-header": ([header()[:-2], ENC.encode(P.StatusQuery())], "decode", 7),
    "header-not-a-map": ([ENC.encode([1, 2]), b"\x80"], "decode", 0),
    "non-utf8-kind": ([b"\x82\xa1v\x01\xa4kind\xa2\xff\xfe", b"\x80"], "decode", 0),
    "unknown-kind": ([header(kind="Bogus"), b"\x80"], "unknown", 7),
    "reply-kind-as-request": ([header(kind="Ok"), b"\x80"], "unknown", 7),
    "one-frame": ([header()], "decode", 7),
    "three-frames": ([header(), ENC.encode(P.StatusQuery()), b"x"], "decode", 7),
    "bad-body": ([header(kind="Publish"), ENC.encode({"engine_id": 5})], "decode", 7),
    "unknown-body-field": ([header(kind="StatusQuery"), ENC.encode({"zzz": 1})], "decode", 7),
    "non-utf8-body": ([header(kind="Ping"), b"\x82\xa9engine_id\xa2\xff\xfe\xa7tp_rank\x00"],
                      "decode", 7),
}


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
def test_malformed_messages_get_an_error_and_are_counted(pair, case) -> None:
    frames, reason, msg_id = BAD_MESSAGES[case]
    d = pair.decode
    before = metric(d, "kvd_protocol_errors_total", face="engine", reason=reason)
    err = expect_error(raw_call(d.engine_address, frames), msg_id=msg_id)
    assert err.code in ("protocol", "incompatible"), err
    wait_until(lambda: metric(d, "kvd_protocol_errors_total", face="engine",
                              reason=reason) == before + 1, 3, what=f"{reason} counted")


def test_peer_face_rejects_engine_messages(pair) -> None:
    d = pair.prefill
    before = metric(d, "kvd_protocol_errors_total", face="peer", reason="unknown")
    expect_error(raw_call(d.peer_address, [header(kind="StatusQuery"),
                                           ENC.encode(P.StatusQuery())]), "protocol")
    expect_error(raw_call(d.peer_address, [b"\xc1", b"\xc1"]), "protocol")
    assert metric(d, "kvd_protocol_errors_total", face="peer", reason="unknown") == before + 1


def test_transfer_works_after_protocol_abuse(pair) -> None:
    for frames, _, _ in BAD_MESSAGES.values():
        raw_call(pair.prefill.peer_address, frames, timeout_s=1)
        raw_call(pair.decode.engine_address, frames, timeout_s=1)
    check_still_serving(pair)


# ------------------------------------------------------------------ handshake failures


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> Iterator[DaemonProcess]:
    """A decode daemon that gives up on a handshake after 1 s."""
    d = start_daemon(tmp_path_factory.mktemp("quick"), "q",
                     ["--set", "handshake_timeout_s=1"])
    yield d
    stop_and_check_clean(d)


class SilentRouter:
    """A peer that accepts connections and reads every message, never answering."""

    def __init__(self) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.received = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._ready.set()
        while not self._stop.is_set():
            if sock.poll(50):
                sock.recv_multipart()
                self.received += 1
        sock.close(0)
        ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.parametrize("target", ["nothing-listens", "silent-router"])
def test_handshake_timeout(quick, target) -> None:
    silent = SilentRouter() if target == "silent-router" else None
    address = silent.address if silent else f"tcp://127.0.0.1:{free_port()}"
    with quick.client() as c:
        d = register(c, "dec", MODEL, SHAPE)
        try:
            before = metric(quick, "kvd_handshakes_total", outcome="timeout")
            t0, queued0 = time.monotonic(), run_queue_wait_s(quick.proc.pid)
            c.pull(d.engine_id, "hs", "remote-engine", address, [0, 1], [4, 5])
            ev = c.wait(d.engine_id, "hs", "done_recving", timeout_s=10)
            elapsed = time.monotonic() - t0
            # The upper bound judges the daemon's own time: less what it waited for a CPU.
            own = elapsed - (run_queue_wait_s(quick.proc.pid) - queued0)
            assert not ev.ok and ev.invalid_block_ids == [4, 5]
            assert "timeout" in ev.error or "did not answer" in ev.error, ev.error
            assert elapsed >= 0.9 and own < 3.0, (elapsed, own)
            assert metric(quick, "kvd_handshakes_total", outcome="timeout") == before + 1
            if silent:
                assert silent.received >= 1  # the Hello did arrive; nobody answered
            assert not c.status().pulls
        finally:
            if silent:
                silent.close()
            deregister_and_check_freed(c, d)


# ------------------------------------------------------------------ a peer dies mid-transfer

BIG_MODEL = ModelSpec(name="kill-model", num_kv_heads=8, num_layers=8, head_dim=128)
BIG = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=512)  # 512 KiB/block, 256 MiB
REQUESTS = 8  # 64 blocks = 32 MiB each


def test_prefill_daemon_killed_mid_transfer(pair, tmp_path: Path) -> None:
    """Pulls in flight when the producer dies fail with every local block invalid; any pull
    that did complete holds exactly the right bytes; the decode daemon keeps serving."""
    victim = start_daemon(tmp_path, "victim")
    try:
        d, _ = kill_producer_mid_pulls(pair.dc, victim, BIG_MODEL, BIG, REQUESTS, "kill", 5)
        assert not pair.dc.status().pulls
        deregister_and_check_freed(pair.dc, d)  # nothing stays pinned
    finally:
        victim.kill()
        for name in kvd_segments(f"kvd-{victim.name}"):  # SIGKILL leaves its pools behind
            (SHM_DIR / name).unlink(missing_ok=True)
    check_still_serving(pair)


# ------------------------------------------------------------------ engine liveness


def test_silent_engine_rank_is_dropped_and_its_pool_freed(tmp_path: Path) -> None:
    # pool_backing=shm: the pool is a file to watch on every host (auto takes memfd
    # huge pages where they are reserved)
    d = start_daemon(tmp_path, "live", ["--set", "engine_timeout_s=1", "--set",
                                        "heartbeat_interval_s=0.2", "--set", "lease_s=4",
                                        "--set", "pool_backing=shm"])
    try:
        with d.client(ping_interval_s=0) as silent, d.client(ping_interval_s=0.2) as alive:
            gone = register(silent, "silent", MODEL, SHAPE)
            kept = register(alive, "alive", MODEL, SHAPE)
            pools = {e.engine_id: e.pool for e in alive.status().engines}
            assert (SHM_DIR / pools[gone.engine_id]).exists()
            time.sleep(1.2)
            wait_until(lambda: gone.engine_id not in
                       {e.engine_id for e in alive.status().engines if not e.gone}, 5,
                       what="the silent rank to be dropped")
            # Kept while its engine still maps it (it may come back and take it), freed
            # once nobody does.
            time.sleep(0.3)
            assert (SHM_DIR / pools[gone.engine_id]).exists()
            for r in gone.ranks:
                r.pool.close()
            wait_until(lambda: not (SHM_DIR / pools[gone.engine_id]).exists(), 5,
                       what="its pool to be unlinked")
            ids = {e.engine_id for e in alive.status().engines if not e.gone}
            assert kept.engine_id in ids, "a pinging rank must stay registered"
            with pytest.raises(KvdError, match="not registered"):
                silent.call(P.Ping(engine_id=gone.engine_id, tp_rank=0))
            with pytest.raises(KvdError, match="not registered"):
                silent.publish(gone.engine_id, "r", [0])
            deregister_and_check_freed(alive, kept)
    finally:
        stop_and_check_clean(d)
