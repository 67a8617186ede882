"""Fuzz both faces of a real daemon, then prove it still moves bytes exactly.

100,000+ hostile messages in all: random bytes, truncated and bit-flipped valid
messages, type-confused fields, wrong frame counts, unknown kinds, oversized
frames. Every message must be answered with an Error (or dropped, for frames
the socket refuses) and counted; the daemon must not crash and must complete a
legitimate byte-exact transfer afterwards.
"""

from __future__ import annotations

import random

import msgspec
import pytest
import zmq
from support.raw_zmq import dealer

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire import protocol as P
from kvd.wire.protocol import ModelSpec

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

TOTAL_MESSAGES = 100_000
MODEL = ModelSpec(name="fuzz", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, num_blocks=16)
ENC = msgspec.msgpack.Encoder()
V = P.PROTOCOL_VERSION


def _valid_bodies() -> list[msgspec.Struct]:
    layout = layout_spec(SHAPE)
    desc = P.EngineDesc(engine_id="e", model=MODEL, layout=layout, tp_size=1, pp_size=1,
                        layer_partition=None, ranks=[])
    return [
        P.RegisterEngine(engine_id="fz", model=MODEL, layout=layout, tp_rank=0, tp_size=1),
        P.Publish(engine_id="fz", request_id="r", block_ids=[1, 2]),
        P.Pull(engine_id="fz", request_id="r", remote_engine_id="x",
               remote_address="tcp://127.0.0.1:1", remote_block_ids=[1], local_block_ids=[1]),
        P.Poll(engine_id="fz", timeout_s=0.0),
        P.Deregister(engine_id="fz", tp_rank=0),
        P.Ping(engine_id="fz", tp_rank=0),
        P.Hello(daemon_id="d", remote_engine_id="e", consumer=desc, agent_metadata=b"x",
                compat_hash="h"),
        P.Acquire(request_id="r", producer_engine_id="e", consumer_engine_id="c", block_ids=[1]),
        P.Heartbeat(producer_engine_id="e", request_ids=["r"]),
    ]


_WEIRD = [None, -1, 2**63, -(2**63), 1e308, float("nan"), "", "x" * 300, b"\xff\xfe",
          [], {}, [1, "a", None], {"a": 1}, True, 3.5]


def _type_confused(body: msgspec.Struct, rng: random.Random) -> bytes:
    data = msgspec.to_builtins(body)
    key = rng.choice(sorted(data)) if data else "x"
    data[key] = rng.choice(_WEIRD)
    if rng.random() < 0.3:
        data[f"extra{rng.randrange(9)}"] = rng.choice(_WEIRD)
    return ENC.encode(data)


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    op = rng.randrange(4)
    if op == 0 and frame:
        return frame[: rng.randrange(len(frame))]
    if op == 1 and frame:
        b = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if op == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    return frame + bytes(rng.randrange(256) for _ in range(rng.randrange(16)))


def _hostile(rng: random.Random, bodies: list[msgspec.Struct], msg_id: int) -> list[bytes]:
    body = rng.choice(bodies)
    kind = type(body).__name__
    good_header = ENC.encode(P.Header(v=V, kind=kind, id=msg_id))
    r = rng.random()
    if r < 0.30:  # valid header, type-confused body
        return [good_header, _type_confused(body, rng)]
    if r < 0.55:  # valid header, mutated body
        return [good_header, _mutate(ENC.encode(body), rng)]
    if r < 0.70:  # mutated header
        return [_mutate(good_header, rng), ENC.encode(body)]
    if r < 0.80:  # unknown kind / wrong version
        v = rng.choice([0, 2, 999, P.PROTOCOL_VERSION])
        k = rng.choice(["Nope", "__class__", "Error", "Registered", "x" * 100])
        return [ENC.encode({"v": v, "kind": k, "id": msg_id}), ENC.encode(body)]
    if r < 0.90:  # wrong frame count
        return [good_header] * rng.choice([1, 3, 5])
    return [_mutate(b"", rng) or b"\x00", _mutate(b"", rng) or b"\x00"]  # random bytes


def _blast(address: str, count: int, seed: int) -> int:
    """Send `count` hostile messages pipelined; return how many replies came back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    rng = random.Random(seed)
    bodies = _valid_bodies()
    replies, window = 0, 500
    sent = 0
    try:
        while sent < count:
            n = min(window, count - sent)
            for i in range(n):
                sock.send_multipart(_hostile(rng, bodies, sent + i + 1))
            sent += n
            while replies < sent - 50 and sock.poll(2000):
                frames = sock.recv_multipart()
                # Every answer is a well-formed reply: mostly Error; a mutation
                # that stayed valid by chance gets its normal answer.
                P.decode(frames, P.REPLIES)
                replies += 1
        while sock.poll(1000):
            sock.recv_multipart()
            replies += 1
    finally:
        sock.close(0)
        ctx.term()
    return replies


def _transfer(prefill: DaemonProcess, decode: DaemonProcess, tag: str) -> None:
    g = global_kv(MODEL, 40)
    ids = [3, 7, 1]
    with prefill.client() as pc, decode.client() as dc:
        pr = pc.register(f"p{tag}", MODEL, layout_spec(SHAPE))
        dr = dc.register(f"d{tag}", MODEL, layout_spec(SHAPE))
        write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, ids)
        pc.publish(f"p{tag}", "req", ids)
        dc.pull(f"d{tag}", "req", f"p{tag}", prefill.peer_address, ids, [9, 4, 11])
        ev = dc.wait(f"d{tag}", "req", "done_recving", timeout_s=30)
        assert ev.ok, ev.error
        assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [9, 4, 11]) == 0


def test_fuzz_both_faces_then_transfer_is_exact(tmp_path):
    prefill = DaemonProcess.start("fzp", tmp_path, extra_args=["--set", "max_message_bytes=65536"])
    decode = DaemonProcess.start("fzd", tmp_path)
    try:
        _transfer(prefill, decode, "before")
        half = TOTAL_MESSAGES // 2
        got_engine = _blast(prefill.engine_address, half, seed=1)
        got_peer = _blast(prefill.peer_address, TOTAL_MESSAGES - half, seed=2)
        assert prefill.proc.poll() is None, "daemon died under fuzzing"
        # Nearly every message gets an answer; a few may be valid by chance or dropped.
        assert got_engine + got_peer >= 0.95 * TOTAL_MESSAGES
        errors = prefill.metric("kvd_protocol_errors_total")
        assert errors >= 0.5 * TOTAL_MESSAGES, errors

        # Oversized frame: refused by the socket (MAXMSGSIZE) before any decoding.
        with dealer(prefill.engine_address) as s:
            s.send_multipart([ENC.encode(P.Header(v=V, kind="Publish", id=1)),
                              b"\x00" * 200_000])
            assert not s.poll(500), "an oversized frame must not be answered"
        assert prefill.proc.poll() is None

        _transfer(prefill, decode, "after")
    finally:
        prefill.stop()
        decode.stop()
    assert prefill.proc.returncode == 0
