"""The trace context on the wire (protocol v3): Publish and Pull carry an optional W3C
traceparent, sent as v3 only when set; receivers take v2 and v3; a malformed one is a
protocol error."""

from __future__ import annotations

import pytest

from kvd.wire import protocol as P

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_traceparent_rides_publish_and_pull_as_v3_and_v2_without() -> None:
    traced = P.Pull(engine_id="d", request_id="r", remote_engine_id="p",
                    remote_address="tcp://h:1", remote_block_ids=[0], local_block_ids=[1],
                    traceparent=TP)
    header, body = P.decode(P.encode(traced), P.ENGINE_REQUESTS)
    assert header.v == 3 and body.traceparent == TP
    plain = P.Publish(engine_id="p", request_id="r", block_ids=[0])
    header, body = P.decode(P.encode(plain), P.ENGINE_REQUESTS)
    assert header.v == P.MIN_PROTOCOL_VERSION == 2 and body.traceparent == ""
    assert b"traceparent" not in P.encode(plain)[1]  # omitted: a v2 daemon takes it


@pytest.mark.parametrize("bad", ["01-" + TP[3:], TP.upper(), TP + "-x", "00-abc-def-01"])
def test_a_malformed_traceparent_is_a_protocol_error(bad: str) -> None:
    import msgspec

    frames = [msgspec.msgpack.encode(P.Header(v=3, kind="Publish")),
              msgspec.msgpack.encode({"engine_id": "p", "request_id": "r", "block_ids": [0],
                                      "traceparent": bad})]
    with pytest.raises(P.ProtocolError, match="traceparent"):
        P.decode(frames, P.ENGINE_REQUESTS)


def test_v2_headers_are_accepted_and_v4_refused() -> None:
    from kvd.errors import VersionError

    body = msgspec_body()
    for v in (2, 3):
        P.decode([header(v), body], P.ENGINE_REQUESTS)
    with pytest.raises(VersionError, match="2 to 3"):
        P.decode([header(4), body], P.ENGINE_REQUESTS)


def header(v: int) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(P.Header(v=v, kind="Ping"))


def msgspec_body() -> bytes:
    import msgspec

    return msgspec.msgpack.encode(P.Ping(engine_id="e", tp_rank=0))
