"""Hostile and edge input against real daemons.

Each test names the defect it guards against; each was reproduced before its fix.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from support.cluster import metric, unique, wait_until
from support.raw_zmq import dealer

from kvd.errors import BlockIdError, TooLargeError
from kvd.pool.shm import kvd_segments
from kvd.tools.localcluster import DaemonProcess, free_port
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire import protocol as P
from kvd.wire.protocol import LayoutSpec, ModelSpec

pytestmark = pytest.mark.nixl

DAEMON_ARGS = ["--set", "handshake_timeout_s=1"]
MODEL = ModelSpec(name="hostile", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, num_blocks=16)
ENC = msgspec.msgpack.Encoder()
ROOT = Path(__file__).resolve().parents[2]


def raw_call(address: str, frames: list[bytes], timeout_s: float = 5.0
             ) -> tuple[P.Header, object] | None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart(frames)
        if not s.poll(int(timeout_s * 1000)):
            return None
        return P.decode(s.recv_multipart(), P.REPLIES)
    finally:
        s.close(0)
        ctx.term()


def header(kind: str, msg_id: int = 9, **extra: object) -> bytes:
    return ENC.encode({"v": P.PROTOCOL_VERSION, "kind": kind, "id": msg_id, "token": "",
                       **extra})


# ------------------------------------------------------------------ 4: partial ranks


def test_pull_waits_for_every_rank_then_names_the_missing_ones(pair) -> None:
    """10.4: a pull ran with only some decode TP ranks registered (and said ok)."""
    tp2 = EngineShape(tp_size=2, num_blocks=16)
    pe, de = unique("pre"), unique("dec")
    g = global_kv(MODEL, 32)
    pr = pair.pc.register(pe, MODEL, layout_spec(SHAPE))
    d0 = pair.dc.register(de, MODEL, layout_spec(tp2), 0, 2)
    try:
        write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2])
        pair.pc.publish(pe, "r-missing", [1, 2])
        pair.dc.pull(de, "r-missing", pe, pair.prefill.peer_address, [1, 2], [3, 4])
        ev = pair.dc.wait(de, "r-missing", "done_recving", timeout_s=10)
        assert not ev.ok and ev.error.startswith("incomplete"), ev.error
        assert "'1/0'" in ev.error or "1/0" in ev.error, ev.error
        # A rank registering during the wait lets the pull run, byte-exact on both ranks.
        pair.pc.publish(pe, "r-late", [1, 2])
        pair.dc.pull(de, "r-late", pe, pair.prefill.peer_address, [1, 2], [5, 6])
        time.sleep(0.3)
        d1 = pair.dc.register(de, MODEL, layout_spec(tp2), 1, 2)
        ev = pair.dc.wait(de, "r-late", "done_recving", timeout_s=10)
        assert ev.ok, ev.error
        for r in (d0, d1):
            assert check_shard(r.kv, g, MODEL, tp2, r.tp_rank, 0, [5, 6]) == 0
        pair.dc.deregister(d1)
    finally:
        pair.dc.deregister(d0)
        pair.pc.deregister(pr)


# ------------------------------------------------------------------ 5: error codes


def test_bad_block_ids_get_their_own_code_naming_them(pair) -> None:
    """10.5: out-of-range or negative ids were the generic 'error'."""
    pe, de = unique("pre"), unique("dec")
    pr = pair.pc.register(pe, MODEL, layout_spec(SHAPE))
    dr = pair.dc.register(de, MODEL, layout_spec(SHAPE))
    try:
        with pytest.raises(BlockIdError, match=r"\[-1, 99\]"):
            pair.pc.publish(pe, "r", [1, -1, 99])
        with pytest.raises(BlockIdError, match=r"\[16\]"):
            pair.dc.pull(de, "r", pe, pair.prefill.peer_address, [1], [16])
        with pytest.raises(BlockIdError, match=r"\[-5\]"):
            pair.dc.pull(de, "r", pe, pair.prefill.peer_address, [-5], [1])
        pair.pc.publish(pe, "r", [1, 2])
        pair.dc.pull(de, "r", pe, pair.prefill.peer_address, [1, 3], [4, 5])  # 3: unpublished
        ev = pair.dc.wait(de, "r", "done_recving", timeout_s=10)
        assert not ev.ok and ev.error.startswith("bad_block_ids") and "[3]" in ev.error
    finally:
        pair.pc.deregister(pr)
        pair.dc.deregister(dr)


# ------------------------------------------------------------------ 6: pool size


def test_huge_registration_is_too_large_and_leaves_no_file(pair) -> None:
    """10.6: num_blocks = 2**58 raised OverflowError inside the daemon (internal) and
    left a 0-byte shm file."""
    before = kvd_segments(f"kvd-{pair.decode.name}")
    with pytest.raises(TooLargeError, match="max_pool_bytes"):
        pair.dc.register(unique("huge"), MODEL, LayoutSpec(num_blocks=2**58,
                                                             block_size_tokens=16))
    # No new file (pools of earlier tests may still be going away meanwhile).
    assert set(kvd_segments(f"kvd-{pair.decode.name}")) <= set(before)
    assert pair.dc.status().daemon_id


# ------------------------------------------------------------------ 7, 11: headers


def test_deeply_nested_header_is_a_counted_protocol_error_with_the_id(pair) -> None:
    """10.7: RecursionError escaped the decode boundary ('internal', id 0, not counted)."""
    d = pair.decode
    before = metric(d, "kvd_protocol_errors_total", face="engine", reason="limit")
    nested = b"\x91" * 3000 + b"\x00"
    hdr = (b"\x84\xa1v" + ENC.encode(P.PROTOCOL_VERSION) + b"\xa4kind\xabStatusQuery"
           + b"\xa2id\x2a\xa1x" + nested)
    got = raw_call(d.engine_address, [hdr, ENC.encode(P.StatusQuery())])
    assert got is not None
    h, body = got
    assert isinstance(body, P.Error) and body.code == "protocol", body
    assert h.id == 42
    wait_until(lambda: metric(d, "kvd_protocol_errors_total", face="engine",
                              reason="limit") == before + 1, 3, what="counted")


def test_non_string_token_gets_its_request_id(pair) -> None:
    """10.11: a header whose token is not a string was answered with id 0."""
    got = raw_call(pair.decode.engine_address,
                   [header("StatusQuery", 77, token=12345), ENC.encode(P.StatusQuery())])
    assert got is not None
    h, body = got
    assert isinstance(body, P.Error) and body.code == "protocol"
    assert h.id == 77


# ------------------------------------------------------------------ 9: timeouts


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_non_finite_or_negative_timeouts_are_refused(pair, value: float) -> None:
    """10.9: Poll(timeout_s=NaN) was never answered."""
    eid = unique("poll")
    r = pair.dc.register(eid, MODEL, layout_spec(SHAPE))
    try:
        got = raw_call(pair.decode.engine_address,
                       [header("Poll"), ENC.encode({"engine_id": eid, "timeout_s": value})],
                       timeout_s=3)
        assert got is not None, "never answered"
        assert isinstance(got[1], P.Error) and got[1].code == "protocol"
        assert "timeout_s" in got[1].message
        got = raw_call(pair.decode.engine_address,
                       [header("Publish"), ENC.encode({"engine_id": eid, "request_id": "x",
                                                       "block_ids": [1], "lease_s": value})])
        assert got is not None and isinstance(got[1], P.Error), got
        assert "lease_s" in got[1].message
    finally:
        pair.dc.deregister(r)


# ------------------------------------------------------------------ 11: client close


def test_client_close_deregisters_its_ranks(pair) -> None:
    """10.11: KvdClient.close() left its ranks registered until engine_timeout_s."""
    eid = unique("closer")
    with pair.decode.client(ping_interval_s=0) as c:
        c.register(eid, MODEL, layout_spec(SHAPE))
        assert [e.engine_id for e in pair.dc.status().engines if e.engine_id == eid]
    wait_until(lambda: not [e for e in pair.dc.status().engines if e.engine_id == eid], 3,
               what="ranks deregistered by close()")


# ------------------------------------------------------------------ 8: flood


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_unauthenticated_flood_is_cheap_bounded_and_good_clients_are_served(tmp_path) -> None:
    """10.8: every unauthenticated 16 MiB body was decoded (0.3 s of loop each) and the
    daemon grew to ~1.1 GiB under a flood."""
    token = "flood-test-token-0123456789"
    tf = tmp_path / "token"
    tf.write_text(token)
    d = DaemonProcess.start("flood", tmp_path, extra_args=["--auth-token-file", str(tf)],
                            token=token)
    messages, replies = 48, []
    body = ENC.encode(P.Publish(engine_id="e", request_id="r",
                                block_ids=list(range(2**20, 2**20 + 3_000_000))))
    assert 12 * 2**20 < len(body) < 16 * 2**20
    try:
        rss0, peak = _rss_kib(d.proc.pid), 0
        with dealer(d.engine_address) as s:
            t0 = time.monotonic()

            def flood() -> None:
                for i in range(messages):
                    s.send_multipart([header("Publish", i + 1, token="wrong"), body], copy=False)

            sender = threading.Thread(target=flood)
            sender.start()
            slowest = 0.0
            try:
                with d.client(ping_interval_s=0) as good:
                    while len(replies) < messages and time.monotonic() - t0 < 60:
                        t = time.monotonic()
                        assert good.status().daemon_id
                        slowest = max(slowest, time.monotonic() - t)
                        peak = max(peak, _rss_kib(d.proc.pid))
                        while s.poll(0):
                            replies.append(P.decode(s.recv_multipart(), P.REPLIES))
                        time.sleep(0.02)
            finally:
                sender.join()  # before the socket it sends on is closed
            elapsed = time.monotonic() - t0
        assert len(replies) == messages
        assert all(isinstance(b, P.Error) and b.code == "unauthorized" for _, b in replies)
        assert d.metric("kvd_auth_failures_total", face="engine") == messages
        assert elapsed < 10, f"{messages} unauthenticated 16 MiB messages took {elapsed:.1f}s"
        assert slowest < 1.0, f"a good client waited {slowest:.2f}s during the flood"
        grown_mib = (peak - rss0) / 1024
        bound_mib = 256 + 64  # receive_queue_bytes per connection, plus decoding slack
        assert grown_mib < bound_mib, f"daemon grew {grown_mib:.0f} MiB under the flood"
    finally:
        d.stop()


# ------------------------------------------------------------------ 10: drain


def test_drain_timeout_fails_stuck_pulls_on_time(tmp_path) -> None:
    """10.10: SIGTERM with drain_timeout_s=3 and pulls in flight took ~5 s."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts Hellos, never answers: pulls stay stuck
    silent.setsockopt(zmq.LINGER, 0)
    silent_addr = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(silent_addr)
    d = DaemonProcess.start("drainstuck", tmp_path, extra_args=[
        "--set", "drain_timeout_s=1", "--set", "handshake_timeout_s=30",
        "--set", "transfer_timeout_s=60"])
    try:
        with d.client(ping_interval_s=0) as c:
            c.register("dec", MODEL, layout_spec(SHAPE))
            for i in range(3):
                c.pull("dec", f"stuck{i}", "pre", silent_addr, [1], [i + 1])
            wait_until(lambda: len(c.status().pulls) == 3, 5, what="pulls in flight")
            got: list[P.Event] = []
            poller = threading.Thread(target=lambda: got.extend(c.poll("dec", timeout_s=10)))
            poller.start()
            time.sleep(0.2)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            poller.join(10)
            failed_s = time.monotonic() - t0
            assert d.proc.wait(10) == 0
        assert failed_s < 1.0 + 0.5, f"pulls failed {failed_s:.2f}s after SIGTERM"
        assert sorted(e.request_id for e in got) == ["stuck0", "stuck1", "stuck2"], got
        assert all(not e.ok and e.error.startswith("draining") for e in got), got
        assert "shutdown balance: registrations=0 transfers=0" in d.log_path.read_text()
    finally:
        d.stop()
        silent.close(0)
        ctx.term()



# ------------------------------------------------------------------ 3: prefix placement


def test_prefix_hit_with_larger_prefill_blocks_is_exact_or_refused(pair) -> None:
    """10.3: with a partial decode-side hit and no token count, wrong tokens were placed
    and the event said ok. 80 tokens in 32-token prefill blocks (3 blocks, the last
    half full) and 16-token decode blocks (5 blocks)."""
    pshape = EngineShape(tp_size=1, block_size_tokens=32, num_blocks=8)
    dshape = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=16)
    pe, de = unique("pre"), unique("dec")
    g = global_kv(MODEL, 80)
    pr = pair.pc.register(pe, MODEL, layout_spec(pshape))
    dr = pair.dc.register(de, MODEL, layout_spec(dshape))
    addr = pair.prefill.peer_address
    try:
        write_shard(pr.kv, g, MODEL, pshape, 0, 0, [1, 2, 3])
        cases = {  # request id: (local ids, num_tokens, expected error prefix or None)
            "hit16-no-count": ([4, 5, 6, 7], -1, "bad_layout"),  # ambiguous: refused
            "hit16-count": ([4, 5, 6, 7], 80, "bad_layout"),  # hit ends mid prefill block
            "hit32-count": ([8, 9, 10], 80, None),  # tokens 32..80: exact
            "nohit-count": ([11, 12, 13, 14, 15], 80, None),
        }
        for rid, (local, tokens, _) in cases.items():
            pair.pc.publish(pe, rid, [1, 2, 3])
            pair.dc.pull(de, rid, pe, addr, [1, 2, 3], local, num_tokens=tokens)
        for rid, (local, _, err) in cases.items():
            ev = pair.dc.wait(de, rid, "done_recving", timeout_s=10)
            if err is None:
                assert ev.ok, (rid, ev.error)
                first = 80 - 16 * len(local)
                assert check_shard(dr.kv, g, MODEL, dshape, 0, 0, local, first_token=first) == 0
            else:
                assert not ev.ok and ev.error.startswith(err), (rid, ev.error)
                assert ev.invalid_block_ids == local
    finally:
        pair.pc.deregister(pr)
        pair.dc.deregister(dr)
