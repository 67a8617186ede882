"""kv_layout "auto" end to end on two in-process daemons (LoopbackTransport, fake clock).

Engines of different TP sizes register with "auto" on two daemons; each daemon resolves
it on its own, the engines learn the layout from the registration reply (their pools
are shaped by it), and the pull is byte-exact. What crosses the peer face (the Hello's
EngineDesc and compatibility hash, the HelloReply's EngineDesc) names the resolved
layout, never "auto".
"""

from __future__ import annotations

from typing import Any

import pytest
from support.inprocess import daemon_pair, run, wait_event

from kvd.client import AsyncKvdClient
from kvd.daemon.engines.table import compat_hash
from kvd.tools.sim import EngineShape, check_shard, global_kv, write_shard
from kvd.wire import protocol as P

PLAIN = P.ModelSpec(name="auto-pull", num_kv_heads=4, num_layers=3, head_dim=32)
MLA = P.ModelSpec(name="auto-pull-mla", num_kv_heads=1, num_layers=3, head_dim=48, mla=True)
BLOCKS, BS, TOKENS = 16, 16, 64


def layout(kv_layout: str = "auto", head_layout: str = "HND") -> P.LayoutSpec:
    return P.LayoutSpec(num_blocks=BLOCKS, block_size_tokens=BS, kv_layout=kv_layout,
                        head_layout=head_layout)


async def register(client: AsyncKvdClient, engine_id: str, model: P.ModelSpec,
                   spec: P.LayoutSpec, tp: int, pp: int = 1) -> list[Any]:
    return [await client.register(engine_id, model, spec, t, tp, p, pp)
            for p in range(pp) for t in range(tp)]


def shape_of(handles: list[Any], tp: int, pp: int = 1) -> EngineShape:
    """The engine's own view of its pools: the layout the daemon answered with."""
    kv_layouts = {h.kv_layout for h in handles}
    assert len(kv_layouts) == 1 and "auto" not in kv_layouts
    return EngineShape(tp_size=tp, pp_size=pp, block_size_tokens=BS, num_blocks=BLOCKS,
                       kv_layout=handles[0].layout.kv_layout,
                       head_layout=handles[0].layout.head_layout)


# id: (model, head_layout, prefill (tp, pp, layout), decode (tp, pp, layout), resolved)
CASES = {
    "hnd-tp1-tp2": (PLAIN, "HND", (1, 1, "auto"), (2, 1, "auto"), "head_major"),
    "hnd-tp4-tp2": (PLAIN, "HND", (4, 1, "auto"), (2, 1, "auto"), "head_major"),
    "hnd-tp2pp1-tp1pp3": (PLAIN, "HND", (2, 1, "auto"), (1, 3, "auto"), "head_major"),
    "hnd-explicit-prefill-auto-decode": (PLAIN, "HND", (2, 1, "head_major"), (1, 1, "auto"),
                                         "head_major"),
    "nhd-tp2-tp2-pp-split": (PLAIN, "NHD", (2, 1, "auto"), (2, 3, "auto"), "cross_layer"),
    "mla-tp2-tp3": (MLA, "HND", (2, 1, "auto"), (3, 1, "auto"), "cross_layer"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_auto_engines_of_different_shapes_pull_byte_exact(case: str) -> None:
    model, head_layout, (ptp, ppp, play), (dtp, dpp, dlay), resolved = CASES[case]

    async def body() -> None:
        async with daemon_pair() as p:
            hellos: list[tuple[P.Hello, P.HelloReply]] = []
            real_hello = p.prefill.producer.hello

            async def recording_hello(msg: P.Hello) -> P.HelloReply:
                reply = await real_hello(msg)
                hellos.append((msg, reply))
                return reply

            p.prefill.producer.hello = recording_hello  # type: ignore[method-assign]
            pre = await register(p.pc, "pre", model, layout(play, head_layout), ptp, ppp)
            dec = await register(p.dc, "dec", model, layout(dlay, head_layout), dtp, dpp)
            pshape, dshape = shape_of(pre, ptp, ppp), shape_of(dec, dtp, dpp)
            assert pshape.kv_layout == dshape.kv_layout == resolved
            g = global_kv(model, TOKENS)
            p_ids, d_ids = [9, 2, 14, 5], [3, 11, 0, 7]
            for h in pre:
                write_shard(h.kv, g, model, pshape, h.tp_rank, h.pp_rank, p_ids)
            await p.pc.publish("pre", "r1", p_ids)
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, p_ids, d_ids,
                            num_tokens=TOKENS)
            recv = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert recv.ok, recv.error
            for h in dec:
                assert check_shard(h.kv, g, model, dshape, h.tp_rank, h.pp_rank, d_ids) == 0
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert sent.ok

            # what crossed the peer face: the resolved layout only
            assert hellos, "the pull greeted the producer"
            concrete = layout(resolved, head_layout)
            for hello, reply in hellos:
                assert hello.consumer.layout == concrete
                assert reply.engine.layout == concrete
                assert hello.compat_hash == compat_hash(model, concrete)
            for remote in p.decode.peers.remotes.values():
                assert remote.desc.layout.kv_layout == resolved

    run(body())


def test_registration_reply_and_handle_carry_the_resolved_layout() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            h, _ = await register(p.pc, "e", PLAIN, layout(), 2)
            assert h.layout == layout("head_major") and h.kv_layout == "head_major"
            # (blocks, heads of the rank, layers, kv, tokens, head_dim)
            assert h.kv.shape == (BLOCKS, 2, 3, 2, BS, 32)
            assert list(h.pool.handle.shape) == list(h.kv.shape)
            [n] = await register(p.pc, "n", PLAIN, layout(head_layout="NHD"), 1)
            assert n.layout == layout("cross_layer", "NHD")
            assert n.kv.shape == (BLOCKS, 3, 2, BS, 4, 32)  # NHD body: tokens, heads, dim
            # an explicit layout comes back as sent
            [x] = await register(p.pc, "x", PLAIN, layout("kv_split"), 1)
            assert x.layout == layout("kv_split")

    run(body())


def test_a_reply_without_layout_means_the_requested_one(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A daemon from before "auto" sends no Registered.layout: the handle keeps the
    layout the engine asked for (such a daemon refuses "auto" itself). Older clients
    ignore the new reply field."""
    import msgspec

    from kvd.client import core as client_core

    class RegisteredV2(msgspec.Struct, frozen=True):  # Registered before this change
        pool: P.PoolHandle
        daemon_id: str
        peer_address: str
        instance_id: str = ""

    monkeypatch.setattr(client_core, "map_pool", lambda handle: None)
    pool = P.PoolHandle(kind="shm", name="x", nbytes=8, shape=[4], dtype="bfloat16")
    msg = client_core.Messages.register("e", PLAIN, layout("kv_split"), 0, 1, 0, 1, None, [])
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(RegisteredV2(pool, "d", "tcp://a:1")),
                                 type=P.Registered)
    assert old.layout is None
    assert client_core.Messages.handle(msg, old).layout == layout("kv_split")
    new = P.Registered(pool, "d", "tcp://a:1", "i", layout=layout("head_major"))
    auto_msg = client_core.Messages.register("e", PLAIN, layout(), 0, 1, 0, 1, None, [])
    assert client_core.Messages.handle(auto_msg, new).kv_layout == "head_major"
    wire = msgspec.msgpack.encode(new)
    assert msgspec.msgpack.decode(wire, type=RegisteredV2).instance_id == "i"


def test_a_hello_naming_an_unresolved_layout_is_refused() -> None:
    """Only a daemon resolves "auto", for its own engines: a peer that sends it (a bug,
    or a forged Hello whose hash matches the concrete layout) gets bad_layout."""
    import zmq
    import zmq.asyncio

    async def body() -> None:
        async with daemon_pair() as p:
            [pre] = await register(p.pc, "pre", PLAIN, layout(), 1)
            resolved = pre.layout
            desc = P.EngineDesc(engine_id="c", model=PLAIN, layout=layout(), tp_size=1,
                                pp_size=1, layer_partition=None, ranks=[])
            hello = P.Hello(daemon_id="d", remote_engine_id="pre", consumer=desc,
                            agent_metadata=b"", compat_hash=compat_hash(PLAIN, resolved))
            ctx = zmq.asyncio.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(p.prefill.cfg.peer_address)
            try:
                await s.send_multipart(P.encode(hello, 1))
                _, reply = P.decode(await s.recv_multipart(), P.REPLIES)
            finally:
                s.close(0)
                ctx.term()
            assert isinstance(reply, P.Error) and reply.code == "bad_layout", reply
            assert "auto" in reply.message

    run(body())
