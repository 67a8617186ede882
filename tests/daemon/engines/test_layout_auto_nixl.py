"""kv_layout "auto" through two ``kvd serve`` processes and real NIXL.

Engines of different TP sizes register with the default layout ("auto") on two
daemons; each engine builds its view of its pools from the layout in its
registration reply, and the pull is checked byte for byte (and no other block
written) as the shape matrix checks explicit layouts.
"""

from __future__ import annotations

import random

import pytest
from support.cluster import (
    Engine,
    deregister_and_check_freed,
    unique,
    untouched_blocks_nonzero,
)

from kvd.client import KvdClient
from kvd.tools.sim import EngineShape, check_shard, global_kv, write_shard
from kvd.wire.protocol import LayoutSpec, ModelSpec

pytestmark = pytest.mark.nixl

PLAIN = ModelSpec(name="itest-auto", num_kv_heads=8, num_layers=4, head_dim=64)
MLA = ModelSpec(name="itest-auto-mla", num_kv_heads=1, num_layers=4, head_dim=96, mla=True)
BS, BLOCKS = 16, 40


def register_auto(client: KvdClient, prefix: str, model: ModelSpec, tp: int,
                  head_layout: str = "HND") -> tuple[Engine, EngineShape]:
    """Every rank with LayoutSpec's default kv_layout; the shape the daemon answered."""
    spec = LayoutSpec(num_blocks=BLOCKS, block_size_tokens=BS, head_layout=head_layout)
    assert spec.kv_layout == "auto"
    e = Engine(unique(prefix), model, EngineShape(tp_size=tp))
    e.ranks = [client.register(e.engine_id, model, spec, t, tp) for t in range(tp)]
    layouts = {(r.layout.kv_layout, r.layout.head_layout) for r in e.ranks}
    assert len(layouts) == 1
    [(kv_layout, head)] = layouts
    e.shape = EngineShape(tp_size=tp, block_size_tokens=BS, num_blocks=BLOCKS,
                          kv_layout=kv_layout, head_layout=head)
    return e, e.shape


@pytest.mark.parametrize(("model", "ptp", "dtp", "head_layout", "resolved"), [
    (PLAIN, 1, 2, "HND", "head_major"),
    (PLAIN, 4, 2, "HND", "head_major"),
    (MLA, 2, 3, "HND", "cross_layer"),
    (PLAIN, 2, 2, "NHD", "cross_layer"),
], ids=["hnd-1-2", "hnd-4-2", "mla-2-3", "nhd-2-2"])
def test_auto_layout_engines_pull_byte_exact(pair, model: ModelSpec, ptp: int, dtp: int,
                                             head_layout: str, resolved: str) -> None:
    rng = random.Random(7)
    tokens = 200  # a partial last block
    p, pshape = register_auto(pair.pc, "pre", model, ptp, head_layout)
    d, dshape = register_auto(pair.dc, "dec", model, dtp, head_layout)
    try:
        assert pshape.kv_layout == dshape.kv_layout == resolved
        g = global_kv(model, tokens, seed=5)
        n = -(-tokens // BS)
        p_ids, d_ids = rng.sample(range(BLOCKS), n), rng.sample(range(BLOCKS), n)
        for r in p.ranks:
            write_shard(r.kv, g, model, pshape, r.tp_rank, r.pp_rank, p_ids)
        rid = unique("req")
        pair.pc.publish(p.engine_id, rid, p_ids)
        pair.dc.pull(d.engine_id, rid, p.engine_id, pair.prefill.peer_address, p_ids, d_ids,
                     num_tokens=tokens)
        recv = pair.dc.wait(d.engine_id, rid, "done_recving", timeout_s=30)
        assert recv.ok, recv.error
        assert pair.pc.wait(p.engine_id, rid, "done_sending", timeout_s=30).ok
        for r in d.ranks:
            assert check_shard(r.kv, g, model, dshape, r.tp_rank, r.pp_rank, d_ids) == 0
            assert untouched_blocks_nonzero(r.kv, dshape, d_ids) == 0
    finally:
        deregister_and_check_freed(pair.pc, p)
        deregister_and_check_freed(pair.dc, d)
