"""An engine whose ranks live on several daemons (TP spread over nodes)."""

from __future__ import annotations

import pytest

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="multi", num_kv_heads=8, num_layers=4, head_dim=32)


def test_decode_reads_prefill_ranks_from_two_daemons(tmp_path):
    node_a = DaemonProcess.start("mna", tmp_path)
    node_b = DaemonProcess.start("mnb", tmp_path)
    decode = DaemonProcess.start("mnd", tmp_path)
    pshape = EngineShape(tp_size=4, num_blocks=32)
    dshape = EngineShape(tp_size=2, num_blocks=32)
    g = global_kv(MODEL, 10 * 16)
    p_ids, d_ids = list(range(10)), list(range(31, 21, -1))
    daemons = [node_a.peer_address, node_b.peer_address]
    try:
        with node_a.client() as ac, node_b.client() as bc, decode.client() as dc:
            ranks = []
            for tp in range(4):  # ranks 0,1 on node A; 2,3 on node B
                c = ac if tp < 2 else bc
                r = c.register("p", MODEL, layout_spec(pshape), tp, 4, engine_daemons=daemons)
                write_shard(r.kv, g, MODEL, pshape, tp, 0, p_ids)
                ranks.append(r)
            ac.publish("p", "req", p_ids)
            bc.publish("p", "req", p_ids)
            d_ranks = [dc.register("d", MODEL, layout_spec(dshape), tp, 2) for tp in range(2)]
            # The decode side names only node A; the handshake finds node B through it.
            dc.pull("d", "req", "p", node_a.peer_address, p_ids, d_ids)
            ev = dc.wait("d", "req", "done_recving", timeout_s=30)
            assert ev.ok, ev.error
            for r in d_ranks:
                assert check_shard(r.kv, g, MODEL, dshape, r.tp_rank, 0, d_ids) == 0
            assert ac.wait("p", "req", "done_sending", timeout_s=10).ok
            assert bc.wait("p", "req", "done_sending", timeout_s=10).ok
            peers = {p.address for p in dc.status().peers}
            assert peers == set(daemons)
    finally:
        for d in (node_a, node_b, decode):
            d.stop()


def test_missing_rank_daemon_is_a_clear_error(tmp_path):
    node_a = DaemonProcess.start("mma", tmp_path)
    decode = DaemonProcess.start("mmd", tmp_path)
    shape = EngineShape(tp_size=2, num_blocks=8)
    try:
        with node_a.client() as ac, decode.client() as dc:
            ac.register("p", MODEL, layout_spec(shape), 0, 2)  # rank 1 is nowhere
            ac.publish("p", "req", [1])
            dc.register("d", MODEL, layout_spec(EngineShape(tp_size=1, num_blocks=8)))
            dc.pull("d", "req", "p", node_a.peer_address, [1], [2])
            ev = dc.wait("d", "req", "done_recving", timeout_s=30)
            assert not ev.ok and "not hosted by any daemon" in ev.error
            assert ev.invalid_block_ids == [2]
    finally:
        node_a.stop()
        decode.stop()
