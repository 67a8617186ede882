"""One published request read by two decode engines of different TP sizes (consumers=2)."""

from __future__ import annotations

import pytest

from kvd.errors import KvdTimeoutError
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="fanout", num_kv_heads=4, num_layers=4, head_dim=32)


def test_producer_waits_for_every_consumer_engine(tmp_path):
    prefill = DaemonProcess.start("fop", tmp_path)
    dec_a = DaemonProcess.start("foa", tmp_path)
    dec_b = DaemonProcess.start("fob", tmp_path)
    pshape = EngineShape(tp_size=2, num_blocks=16)
    shapes = {"a": EngineShape(tp_size=1, num_blocks=16),
              "b": EngineShape(tp_size=4, num_blocks=16)}
    g = global_kv(MODEL, 6 * 16)
    p_ids, d_ids = [0, 2, 4, 6, 8, 10], [15, 14, 13, 12, 11, 10]
    try:
        with prefill.client() as pc, dec_a.client() as ac, dec_b.client() as bc:
            for t in range(2):
                r = pc.register("p", MODEL, layout_spec(pshape), t, 2)
                write_shard(r.kv, g, MODEL, pshape, t, 0, p_ids)
            pc.publish("p", "req", p_ids, consumers=2)
            for name, client in (("a", ac), ("b", bc)):
                shape = shapes[name]
                ranks = [client.register(name, MODEL, layout_spec(shape), t, shape.tp_size)
                         for t in range(shape.tp_size)]
                client.pull(name, "req", "p", prefill.peer_address, p_ids, d_ids)
                ev = client.wait(name, "req", "done_recving", timeout_s=30)
                assert ev.ok, ev.error
                for r in ranks:
                    assert check_shard(r.kv, g, MODEL, shape, r.tp_rank, 0, d_ids) == 0
                if name == "a":  # one consumer done of two: the blocks stay held
                    with pytest.raises(KvdTimeoutError):
                        pc.wait("p", "req", "done_sending", timeout_s=0.5)
                    assert [h.consumers_done for h in pc.status().held] == [1]
            sent = pc.wait("p", "req", "done_sending", timeout_s=10)
            assert sent.ok and sent.nbytes == 2 * ev.nbytes
    finally:
        for d in (prefill, dec_a, dec_b):
            d.stop()
