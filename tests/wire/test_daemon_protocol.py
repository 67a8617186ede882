"""The single decode boundary: hostile input gives ProtocolError, never another exception."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.wire import protocol as P

ENC = msgspec.msgpack.Encoder()
V = P.PROTOCOL_VERSION
MODEL = P.ModelSpec(name="m", num_kv_heads=4, num_layers=2, head_dim=32)
LAYOUT = P.LayoutSpec(num_blocks=8, block_size_tokens=16)
VALID = [
    P.RegisterEngine(engine_id="e", model=MODEL, layout=LAYOUT, tp_rank=0, tp_size=1),
    P.Publish(engine_id="e", request_id="r", block_ids=[1, 2]),
    P.Pull(engine_id="e", request_id="r", remote_engine_id="x", remote_address="tcp://h:1",
           remote_block_ids=[1], local_block_ids=[2]),
    P.Poll(engine_id="e"),
    P.Heartbeat(producer_engine_id="e", request_ids=["r"]),
    P.Acquire(request_id="r", producer_engine_id="e", consumer_engine_id="c", block_ids=[1]),
]
ALL_REQUESTS = P.ENGINE_REQUESTS + P.PEER_REQUESTS


def decode_or_protocol_error(frames: list[bytes], allowed=ALL_REQUESTS) -> None:
    try:
        P.decode(frames, allowed)
    except ProtocolError:
        pass  # anything else propagates and fails the test


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_roundtrip(msg) -> None:
    header, body = P.decode(P.encode(msg, msg_id=42, token="t"), ALL_REQUESTS)
    # sent as the oldest version that carries it: none of these has a trace context
    assert header == P.Header(v=P.MIN_PROTOCOL_VERSION, kind=type(msg).__name__, id=42,
                              token="t")
    assert body == msg


def test_version_is_checked_before_the_body() -> None:
    frames = [ENC.encode(P.Header(v=999, kind="Publish")), b"\xc1 not even msgpack"]
    with pytest.raises(ProtocolError) as info:
        P.decode(frames, ALL_REQUESTS)
    assert info.value.code == "incompatible"
    assert info.value.reason == "version"
    assert "999" in str(info.value)


def test_header_tolerates_unknown_fields_bodies_do_not() -> None:
    hdr = ENC.encode({"v": P.PROTOCOL_VERSION, "kind": "Poll", "id": 3, "mac": "future"})
    header, body = P.decode([hdr, ENC.encode(P.Poll(engine_id="e"))], ALL_REQUESTS)
    assert header.id == 3 and body.engine_id == "e"
    with pytest.raises(ProtocolError) as info:
        P.decode([hdr, ENC.encode({"engine_id": "e", "surprise": 1})], ALL_REQUESTS)
    assert info.value.reason == "decode"


@pytest.mark.parametrize("frames,reason", [
    ([], "decode"),
    ([b""], "decode"),
    ([b"", b"", b""], "decode"),
    ([b"", b""], None),
    ([b"\xc1", b""], None),
    ([ENC.encode(P.Header(v=V, kind="Nope")), b"\x80"], "unknown"),
    ([ENC.encode(P.Header(v=V, kind="Ok")), b"\x80"], "unknown"),  # a reply, not a request
    ([ENC.encode({"v": "1", "kind": "Poll"}), b"\x80"], None),
    ([ENC.encode({"kind": "Poll"}), b"\x80"], None),
    ([b"\x82\xa1v\x01\xa4kind\xa2\xff\xfe", b"\x80"], None),  # invalid UTF-8 in the header
    ([ENC.encode(P.Header(v=V, kind="Ping")), b"\x81\xa9engine_id\xa2\xff\xfe"], "decode"),
    ([ENC.encode(P.Header(v=V, kind="Publish")), ENC.encode({"engine_id": "e"})], "decode"),
    ([ENC.encode(P.Header(v=V, kind="Publish")),
      ENC.encode({"engine_id": "e", "request_id": "r", "block_ids": ["1"]})], "decode"),
])
def test_bad_frames(frames, reason) -> None:
    with pytest.raises(ProtocolError) as info:
        P.decode(frames, ALL_REQUESTS)
    if reason is not None:
        assert info.value.reason == reason


def test_face_restricts_kinds() -> None:
    frames = P.encode(P.Heartbeat(producer_engine_id="e", request_ids=[]))
    with pytest.raises(ProtocolError, match="unknown message kind"):
        P.decode(frames, P.ENGINE_REQUESTS)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames_only_raise_protocol_error(frames) -> None:
    decode_or_protocol_error(frames)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_mutated_valid_messages_only_raise_protocol_error(msg, data) -> None:
    header, body = P.encode(msg, msg_id=1)
    which = data.draw(st.sampled_from(["header", "body"]))
    raw = bytearray(header if which == "header" else body)
    op = data.draw(st.sampled_from(["truncate", "flip", "insert"]))
    if op == "truncate":
        raw = raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif op == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    else:
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=4))
    frames = [bytes(raw), body] if which == "header" else [header, bytes(raw)]
    decode_or_protocol_error(frames)


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID), st.text(max_size=12), _ANY)
def test_type_confused_fields_only_raise_protocol_error(msg, key, value) -> None:
    data = msgspec.to_builtins(msg)
    data[key if key else next(iter(data))] = value
    header = ENC.encode(P.Header(v=V, kind=type(msg).__name__))
    decode_or_protocol_error([header, ENC.encode(data)])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_notifications_only_raise_protocol_error(raw) -> None:
    for candidate in (raw, P.NOTICE_MAGIC + raw):
        try:
            P.decode_notice(candidate)
        except ProtocolError:
            pass


def test_notice_roundtrip_and_magic() -> None:
    n = P.ReadNotice(request_id="r", producer_engine_id="p", consumer_engine_id="c", reads=3)
    assert P.decode_notice(P.encode_notice(n)) == n
    with pytest.raises(ProtocolError, match="magic"):
        P.decode_notice(ENC.encode(n))

