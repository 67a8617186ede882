"""The engine face's direct door (kvd.daemon.direct, kvd.client.direct): an engine of
this host sends over a Unix socket from its own thread, the daemon answers there with
the same checks as on ZMQ, hostile bytes close only their connection, and a client whose
door broke goes on over ZMQ and comes back to the door."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from kvd.client import KvdClient, NoWaitClient
from kvd.client import nowait as nowait_mod
from kvd.tools.localcluster import DaemonProcess, free_port
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire import protocol as P
from kvd.wire import stream as S

pytestmark = pytest.mark.nixl

MODEL = P.ModelSpec(name="direct", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, num_blocks=8)
TOKEN = "direct-token-0123456789"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("direct")
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    d = DaemonProcess.start("direct", tmp, extra_args=["--auth-token-file", str(token_file)],
                            token=TOKEN, timeout_s=60)
    yield d
    d.kill()


def _reply(client: NoWaitClient, timeout_s: float = 5.0) -> nowait_mod.Reply:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        client.wait_reply(0.1)
        got = client.replies()
        if got:
            return got[0]
    raise AssertionError("no reply")


def _raw(d: DaemonProcess) -> socket.socket:
    name = S.direct_name(d.engine_address)
    assert name is not None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(S.address_of(name))
    return s


@contextlib.contextmanager
def _fake_door(port: int = 0) -> Iterator[tuple[socket.socket, str]]:
    """A listener where a daemon of ``port`` (0: a free one) on loopback would have its
    door, and that port's engine address: what a client finds there is this test's."""
    port = port or free_port()
    name = S.direct_name(f"tcp://127.0.0.1:{port}")
    assert name is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(S.address_of(name))
        listener.listen(1)
        yield listener, f"tcp://127.0.0.1:{port}"


def _read_message(s: socket.socket) -> tuple[P.Header, object]:
    reader = S.FrameReader(P.MAX_HEADER_BYTES, 1 << 24)
    while True:
        data = s.recv(65536)
        assert data, "the daemon closed the connection"
        got = reader.feed(data)
        if got:
            return P.decode(list(got[0]), P.REPLIES)


def test_an_engine_of_this_host_is_served_over_the_door(daemon: DaemonProcess) -> None:
    assert "(direct @kvd-engine-tcp-" in daemon.log_path.read_text()
    client = NoWaitClient(daemon.engine_address, token=TOKEN)
    try:
        assert client.send(P.StatusQuery(), "status", time.monotonic())
        assert client.direct and client.sent_direct == 1
        reply = _reply(client)
        assert reply.tag == "status" and isinstance(reply.body, P.Status)
        assert reply.instance == reply.body.instance_id
    finally:
        client.close()


def test_a_parked_poll_is_answered_over_the_door(daemon: DaemonProcess) -> None:
    """Replies sent later (here a Poll held until its timeout) find the direct
    connection they came on, not a ZMQ identity."""
    with KvdClient(daemon.engine_address, token=TOKEN, ping_interval_s=0) as kc:
        kc.register("parked", MODEL, layout_spec(SHAPE))
        client = NoWaitClient(daemon.engine_address, token=TOKEN)
        try:
            t0 = time.monotonic()
            assert client.send(P.Poll(engine_id="parked", timeout_s=0.3), "poll", t0)
            assert client.direct
            reply = _reply(client)
            assert isinstance(reply.body, P.Events) and reply.body.events == []
            assert time.monotonic() - t0 >= 0.25  # held by the daemon, then answered
        finally:
            client.close()


def test_a_wrong_token_is_refused_on_the_door_and_the_connection_goes_on(
        daemon: DaemonProcess) -> None:
    before = daemon.metric("kvd_auth_failures_total", face="engine")
    with _raw(daemon) as s:
        s.sendall(S.pack(P.encode(P.StatusQuery(), 5, "wrong-token")))
        header, body = _read_message(s)
        assert header.id == 5 and isinstance(body, P.Error) and body.code == "unauthorized"
        s.sendall(S.pack(P.encode(P.StatusQuery(), 6, TOKEN)))
        header, body = _read_message(s)
        assert header.id == 6 and isinstance(body, P.Status)
    assert daemon.metric("kvd_auth_failures_total", face="engine") == before + 1


def test_a_malformed_header_gets_an_error_with_its_id(daemon: DaemonProcess) -> None:
    with _raw(daemon) as s:
        good = P.encode(P.StatusQuery(), 9, TOKEN)
        s.sendall(S.pack([good[0][:-3], good[1]]))  # a header cut short
        header, body = _read_message(s)
        assert isinstance(body, P.Error) and body.code == "protocol"


def test_an_oversized_length_closes_only_that_connection(daemon: DaemonProcess) -> None:
    before = daemon.metric("kvd_protocol_errors_total", face="engine", reason="limit")
    with _raw(daemon) as s:
        s.sendall(S.FRAME_HEAD.pack(8, 1 << 30))  # announces 1 GiB: refused from the head
        assert s.recv(1) == b""  # closed by the daemon
    assert daemon.metric("kvd_protocol_errors_total", face="engine",
                         reason="limit") == before + 1
    client = NoWaitClient(daemon.engine_address, token=TOKEN)
    try:
        assert client.send(P.StatusQuery(), "after", time.monotonic()) and client.direct
        assert isinstance(_reply(client).body, P.Status)
    finally:
        client.close()


def test_send_returns_with_the_bytes_already_at_the_daemon() -> None:
    """The point of the door: when ``send`` returns, the request is in the daemon's
    socket, written by the calling thread. No other thread of the engine (a ZMQ I/O
    thread waiting for a CPU behind the engine's computing threads) has to run."""
    with _fake_door() as (listener, address):
        client = NoWaitClient(address, token="t")
        try:
            msg = P.StatusQuery()
            assert client.send(msg, "x", time.monotonic())
            conn, _ = listener.accept()
            with conn:
                data = conn.recv(65536, socket.MSG_DONTWAIT)  # no wait: it is there
                [(header, body)] = S.FrameReader(P.MAX_HEADER_BYTES, 1 << 20).feed(data)
                assert P.decode([header, body], P.ENGINE_REQUESTS)[1] == msg
        finally:
            client.close()


def test_the_door_can_be_turned_off(tmp_path) -> None:
    d = DaemonProcess.start("nodirect", tmp_path, extra_args=["--set", "engine_direct=false"],
                            timeout_s=60)
    try:
        assert "(direct @" not in d.log_path.read_text()
        client = NoWaitClient(d.engine_address, token="")
        try:
            assert client.send(P.StatusQuery(), "s", time.monotonic())
            assert not client.direct and client.sent_direct == 0
            assert isinstance(_reply(client).body, P.Status)  # over ZMQ, as before
        finally:
            client.close()
    finally:
        d.kill()


def test_a_door_that_broke_gives_way_to_zmq_and_comes_back(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon stops: the client's next request goes over ZMQ, which holds it until
    a daemon listens again on the address (as before the door); once ZMQ has nothing
    unanswered and the retry interval has passed, requests take the door again."""
    monkeypatch.setattr(nowait_mod, "DIRECT_RETRY_S", 0.2)
    engine = f"tcp://127.0.0.1:{free_port()}"
    d = DaemonProcess.start("restart1", tmp_path, engine_address=engine, timeout_s=60)
    client = NoWaitClient(engine, token="")
    try:
        assert client.send(P.StatusQuery(), "a", time.monotonic()) and client.direct
        first = _reply(client).instance
        d.kill()
        client.replies()  # sees the closed connection
        assert not client.direct
        assert client.send(P.StatusQuery(), "b", time.monotonic())  # nobody at the door
        assert not client.direct and client.sent_direct == 1  # queued over ZMQ
        d = DaemonProcess.start("restart2", tmp_path, engine_address=engine, timeout_s=60)
        second = _reply(client, timeout_s=20)
        assert second.tag == "b" and second.instance != first
        time.sleep(0.25)
        assert client.send(P.StatusQuery(), "c", time.monotonic())
        assert client.direct and client.sent_direct == 2
        assert _reply(client).tag == "c"
    finally:
        client.close()
        d.kill()


def test_the_door_waits_for_zmq_to_be_answered_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """No request overtakes one sent before it: while a request sent over ZMQ is
    unanswered, later ones go over ZMQ too, even with the door listening."""
    monkeypatch.setattr(nowait_mod, "DIRECT_RETRY_S", 0.0)
    port = free_port()
    client = NoWaitClient(f"tcp://127.0.0.1:{port}", token="")  # nobody listens yet
    try:
        assert client.send(P.StatusQuery(), "zmq", time.monotonic()) and not client.direct
        with _fake_door(port):
            assert client.send(P.StatusQuery(), "later", time.monotonic())
            assert not client.direct and client.sent_direct == 0
            client.forget_older(time.monotonic() + 10, 1.0)  # the ZMQ one given up
            assert client.send(P.StatusQuery(), "door", time.monotonic())
            assert client.direct and client.sent_direct == 1
    finally:
        client.close()


def test_an_ipc_face_has_its_door_beside_its_path(tmp_path) -> None:
    """Engines in other pods reach an ipc:// face through a shared directory: the door
    is a file there too, removed when the daemon stops."""
    path = tmp_path / "engine.sock"
    d = DaemonProcess.start("ipcdoor", tmp_path, engine_address=f"ipc://{path}",
                            timeout_s=60)
    try:
        assert (tmp_path / "engine.sock.direct").exists()
        client = NoWaitClient(f"ipc://{path}", token="")
        try:
            assert client.send(P.StatusQuery(), "s", time.monotonic()) and client.direct
            assert isinstance(_reply(client).body, P.Status)
        finally:
            client.close()
        assert d.stop() == 0
        assert not (tmp_path / "engine.sock.direct").exists()
    finally:
        d.kill()


def test_the_client_switch_reads_like_the_daemons() -> None:
    assert nowait_mod.direct_default({}) is True
    for off in ("0", "false", "no", "off", " OFF "):
        assert nowait_mod.direct_default({"KVD_ENGINE_DIRECT": off}) is False
    assert nowait_mod.direct_default({"KVD_ENGINE_DIRECT": "1"}) is True


class _Face:
    """The face a door answers for, in-process: each request is recorded and held until
    released, so the test sees what `waiting` says meanwhile."""

    name = "engine"
    instance_id = "inst"

    def __init__(self) -> None:
        from kvd.ops.metrics import Metrics

        self.metrics = Metrics()
        self.seen: list[int] = []
        self.release = asyncio.Event()

    async def answer(self, payload, identity, handlers, fd=-1):
        header = P.decode_header(payload[0])
        self.seen.append(header.id)
        await self.release.wait()
        return P.Ok(), header.id


def test_waiting_counts_requests_read_and_still_in_the_kernel() -> None:
    """AfterBurst holds a burst's events while requests wait on the engine face: on the
    door that is a request queued on a connection or bytes not yet read from it."""
    from kvd.daemon.direct import DirectFace

    async def run() -> None:
        face = _Face()
        name = f"@kvd-test-door-{free_port()}"
        door = DirectFace(face, name, 1 << 20, 1 << 24)
        server = asyncio.get_running_loop().create_task(door.serve({}))
        try:
            await asyncio.sleep(0.05)
            assert not door.waiting()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(S.address_of(name))
            await asyncio.sleep(0.05)
            assert not door.waiting()  # a connection, nothing sent
            s.sendall(S.pack(P.encode(P.StatusQuery(), 1, "")))
            assert door.waiting()  # in the kernel, not read yet: the loop has not run
            s.sendall(S.pack(P.encode(P.StatusQuery(), 2, "")))
            await asyncio.sleep(0.05)
            assert face.seen == [1] and door.waiting()  # 2 queued behind 1
            face.release.set()
            await asyncio.sleep(0.05)
            assert face.seen == [1, 2] and not door.waiting()
            s.close()
        finally:
            door.close()
            server.cancel()

    asyncio.run(run())


def test_a_batch_leaves_in_one_write_at_its_end() -> None:
    """A step's pulls, sent inside ``batch()``, reach the daemon together: nothing is
    written before the block ends, then all of them at once. Sent one by one, a thread
    descheduled between two writes lets the daemon read (and answer) the first alone,
    and its event leaves before the others' (the CI failure of
    test_six_pulls_sent_together_report_in_one_poll_reply)."""
    with _fake_door() as (listener, address):
        client = NoWaitClient(address, token="t")
        try:
            msgs = [P.Publish(engine_id="e", request_id=f"r{k}", block_ids=[k])
                    for k in range(6)]
            with client.batch():
                for k, msg in enumerate(msgs):
                    assert client.send(msg, k, time.monotonic())
                with client.batch():  # nested: the outermost end writes
                    pass
                conn, _ = listener.accept()
                with pytest.raises(BlockingIOError):
                    conn.recv(65536, socket.MSG_DONTWAIT)  # nothing written yet
            with conn:
                data = conn.recv(1 << 20, socket.MSG_DONTWAIT)  # every one is there now
                got = S.FrameReader(P.MAX_HEADER_BYTES, 1 << 20).feed(data)
                assert [P.decode(list(f), P.ENGINE_REQUESTS)[1] for f in got] == msgs
                assert client.send(P.StatusQuery(), "after", time.monotonic())
                data = conn.recv(65536, socket.MSG_DONTWAIT)  # out of a batch: at once
                [(header, body)] = S.FrameReader(P.MAX_HEADER_BYTES, 1 << 20).feed(data)
                assert isinstance(P.decode([header, body], P.ENGINE_REQUESTS)[1],
                                  P.StatusQuery)
        finally:
            client.close()


def test_a_door_whose_daemon_does_not_read_refuses_and_keeps_the_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen daemon: the kernel's buffer fills, then the client's own, bounded; past
    it `send` refuses at once (the connector fails that pull now), as ZMQ refuses past
    its high-water mark. It never turns to ZMQ meanwhile: a later request would overtake
    the queued ones."""
    from kvd.client import direct as direct_mod

    monkeypatch.setattr(direct_mod, "MAX_UNSENT_BYTES", 1 << 20)
    with _fake_door() as (_listener, address):
        client = NoWaitClient(address, token="")
        try:
            big = P.Publish(engine_id="e", request_id="r", block_ids=list(range(20_000)))
            sent = 0
            while client.send(big, sent, time.monotonic()):
                sent += 1
                assert sent < 1000, "never refused"
            assert sent > 0 and client.direct and client.sent_direct == sent
            assert client.in_flight == sent  # the refused one is not in flight
        finally:
            client.close()
