"""The direct door's framing (kvd.wire.stream): any split of a byte stream gives back the
messages sent, a length over its bound is refused before anything is buffered, and the
door's name reaches only a daemon of this host."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.wire import protocol as P
from kvd.wire import stream as S


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=64), st.binary(max_size=300)), max_size=8),
       st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=20))
def test_any_split_of_the_stream_gives_back_the_messages(
        messages: list[tuple[bytes, bytes]], cuts: list[int]) -> None:
    data = b"".join(S.pack([h, b]) for h, b in messages)
    reader = S.FrameReader(64, 300)
    got: list[tuple[bytes, bytes]] = []
    at, i = 0, 0
    while at < len(data):
        n = cuts[i % len(cuts)]
        got.extend(reader.feed(data[at:at + n]))
        at, i = at + n, i + 1
    assert got == messages
    assert reader.buffered == 0


def test_real_messages_round_trip() -> None:
    msg = P.Pull(engine_id="e", request_id="r", remote_engine_id="x",
                 remote_address="tcp://h:1", remote_block_ids=[1, 2], local_block_ids=[3, 4])
    reader = S.FrameReader(P.MAX_HEADER_BYTES, 1 << 20)
    [(h, b)] = reader.feed(S.pack(P.encode(msg, 7, "tok")))
    header, body = P.decode([h, b], P.ENGINE_REQUESTS)
    assert (header.id, header.token, body) == (7, "tok", msg)


@pytest.mark.parametrize("header_n,body_n", [(4097, 0), (10, 1025)])
def test_a_length_over_its_bound_is_refused_from_the_head_alone(header_n: int,
                                                                  body_n: int) -> None:
    """Only the 8-byte head has come: the reader refuses without waiting for (or
    buffering) what it announces."""
    reader = S.FrameReader(4096, 1024)
    with pytest.raises(ProtocolError) as err:
        reader.feed(S.FRAME_HEAD.pack(header_n, body_n))
    assert err.value.reason == "limit"


def test_the_door_is_named_after_the_engine_face() -> None:
    assert S.direct_name("tcp://127.0.0.1:7100") == "@kvd-engine-tcp-7100"
    assert S.direct_name("tcp://localhost:7100") == "@kvd-engine-tcp-7100"
    assert S.direct_name("tcp://[::1]:7100") == "@kvd-engine-tcp-7100"
    # a daemon binding any or one address serves the door named after its port
    assert S.direct_name("tcp://0.0.0.0:7100", serving=True) == "@kvd-engine-tcp-7100"
    assert S.direct_name("tcp://10.1.2.3:7100", serving=True) == "@kvd-engine-tcp-7100"
    # an ipc face's door is a file beside it: it reaches whoever reaches the ipc path
    assert S.direct_name("ipc:///run/kvd/engine.sock") == "/run/kvd/engine.sock.direct"
    assert S.address_of("@kvd-engine-tcp-7100") == "\0kvd-engine-tcp-7100"
    assert S.address_of("/run/kvd/engine.sock.direct") == "/run/kvd/engine.sock.direct"


def test_a_client_of_another_host_never_takes_a_local_door() -> None:
    """A daemon of this host on the same port must not get another host's engine."""
    assert S.direct_name("tcp://10.1.2.3:7100") is None
    assert S.direct_name("tcp://kvd-node-3:7100") is None


def test_no_door_where_no_name_fits() -> None:
    assert S.direct_name("ipc:///" + "d" * 120) is None  # sun_path has no room
    assert S.direct_name("ipc://@abstract-zmq-name") is None


def test_no_abstract_door_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S.sys, "platform", "darwin")
    assert S.direct_name("tcp://127.0.0.1:7100") is None
    assert S.direct_name("ipc:///run/kvd/e") == "/run/kvd/e.direct"

