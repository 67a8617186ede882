"""Nothing a peer sends grows a daemon's state beyond what it holds.

In process (fake clock, loopback), so the producer's own containers can be counted.
"""

from __future__ import annotations

import msgspec
import zmq
import zmq.asyncio
from support.inprocess import daemon_pair, run

from kvd.daemon.engines.table import compat_hash
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="bounded", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, block_size_tokens=4, num_blocks=8)


def _sizes(obj: object) -> dict[str, int]:
    return {k: len(v) for k, v in vars(obj).items() if isinstance(v, dict | set | list)}


def test_hellos_from_many_consumer_engines_leave_no_state_behind() -> None:
    """The producer kept one table entry per consumer engine ever named in a Hello."""
    async def body() -> None:
        async with daemon_pair() as p:
            await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
            before = _sizes(p.prefill.producer)
            desc = P.EngineDesc(engine_id="x", model=MODEL, layout=layout_spec(SHAPE),
                                tp_size=1, pp_size=1, layer_partition=None, ranks=[])
            ctx = zmq.asyncio.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(p.prefill.cfg.peer_address)
            n = 300
            for i in range(n):
                hello = P.Hello(daemon_id="d", remote_engine_id="pre",
                                consumer=msgspec.structs.replace(desc, engine_id=f"c{i}"),
                                agent_metadata=b"",
                                compat_hash=compat_hash(MODEL, layout_spec(SHAPE)))
                await s.send_multipart(P.encode(hello, i + 1))
            for _ in range(n):
                _, reply = P.decode(await s.recv_multipart(), P.REPLIES)
                assert isinstance(reply, P.HelloReply)
            s.close(0)
            ctx.term()
            assert _sizes(p.prefill.producer) == before, "Hellos grew the producer's state"

    run(body())
