"""Hybrid engines in the daemon, without NIXL: wire, registration, ids, assembly.

The byte-exact end-to-end cases are tests/daemon/pull/test_hybrid.py; these pin
the rules around them: attention-only messages unchanged on the wire, what the
compatibility key covers, which registrations and block-id lists are refused,
and that a pull's notices add up to the plan's consumer counts.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from support.hybrid_sim import HybridShape, hybrid_spec

from kvd.client.core import Messages, split_block_ids
from kvd.daemon import hybrid
from kvd.daemon.engines.table import compat_hash, validate_registration
from kvd.errors import BlockIdError, LayoutError, PlanError
from kvd.planner.hybrid.assembly import HybridRankPool, assemble_hybrid_pull
from kvd.planner.hybrid.layout import build_hybrid_descriptors
from kvd.planner.hybrid.plan import plan_hybrid
from kvd.planner.plan import RankId
from kvd.planner.topology import Parallelism
from kvd.pool import geometry as hybrid_geometry
from kvd.wire import protocol as P

MAMBA = P.MambaSpecMsg(num_heads=24, head_dim=2, n_groups=2, d_state=4, conv_kernel=4)
GROUPS = [[0, 4], [1, 5], [2, 7], [6]]


def spec(window: int = 7, groups=GROUPS, mamba=MAMBA) -> P.ModelSpec:
    return hybrid_spec("M*S-M*MS", groups, k=2, head_dim=4, mamba=mamba, window=window)


def register(tp: int, tp_rank: int = 0, layout: P.LayoutSpec | None = None,
             model: P.ModelSpec | None = None) -> P.RegisterEngine:
    return P.RegisterEngine(engine_id="e", model=model or spec(),
                            layout=layout or HybridShape(tp).layout, tp_rank=tp_rank,
                            tp_size=tp)


class PullV2(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Pull as an earlier v2 daemon decodes it (no hybrid fields)."""

    engine_id: str
    request_id: str
    remote_engine_id: str
    remote_address: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    remote_request_id: str = ""
    num_tokens: int = -1


def test_attention_only_messages_are_unchanged_on_the_wire() -> None:
    msg = Messages.pull("e", "r", "p", "tcp://x:1", [1, 2], [3, 4], "", 32)
    assert msg.local_group_block_ids is None
    raw = msgspec.msgpack.encode(msg)
    assert msgspec.msgpack.decode(raw, type=PullV2).local_block_ids == [3, 4]
    model = P.ModelSpec(name="m", num_kv_heads=2, num_layers=2, head_dim=4)
    assert "hybrid" not in msgspec.msgpack.decode(msgspec.msgpack.encode(model))
    pub = Messages.publish("e", "r", [1, 2], None, 1)
    assert "group_block_ids" not in msgspec.msgpack.decode(msgspec.msgpack.encode(pub))


def test_clients_send_group_lists_with_their_concatenation() -> None:
    assert split_block_ids([3, 1]) == ([3, 1], None)
    assert split_block_ids([[7], [1, 2], []]) == ([7, 1, 2], [[7], [1, 2], []])
    pull = Messages.pull("e", "r", "p", "a", [[5], [6, 7]], [[1], [2]], "", 9)
    assert pull.remote_block_ids == [5, 6, 7] and pull.remote_group_block_ids == [[5], [6, 7]]
    assert P.decode(P.encode(pull, 1), P.ENGINE_REQUESTS)[1] == pull


def test_compat_key_covers_the_hybrid_description_not_tp_or_blocks() -> None:
    lay = HybridShape(1).layout
    base = compat_hash(spec(), lay)
    assert base == compat_hash(spec(), HybridShape(4, kernel_block_tokens=8,
                                                   num_blocks=9).layout)
    other_mamba = msgspec.structs.replace(MAMBA, d_state=8)
    for changed in (spec(window=8), spec(mamba=other_mamba),
                    spec(groups=[[0, 4, 6], [1, 5], [2, 7]])):
        assert compat_hash(changed, lay) != base
    plain = P.ModelSpec(name="itest-hybrid", num_kv_heads=2, num_layers=8, head_dim=4,
                        dtype="float32")
    assert compat_hash(plain, lay) != base
    # the attention page order is part of it: a blocks_first engine cannot serve an LBHNC one
    assert compat_hash(spec(), HybridShape(1, kv_layout="LBHNC").layout) != base


def test_registration_sizes_the_pool_by_the_hybrid_layout() -> None:
    for tp in (1, 2, 4, 6, 8):
        par, pool, first = validate_registration(register(tp))
        assert isinstance(pool, hybrid_geometry.HybridPool) and first == 0
        lay = hybrid_geometry.hybrid_rank_layout(spec(), HybridShape(tp).layout, par, 0)
        assert pool.layout == lay
        assert lay.end_nbytes <= pool.total_nbytes < lay.end_nbytes + hybrid_geometry.POOL_ALIGN
        assert pool.shape == (pool.total_nbytes // 4,)  # float32 elements


def test_registration_refusals_name_the_problem() -> None:
    with pytest.raises(LayoutError, match="layer outermost, whole blocks contiguous"):
        validate_registration(register(1, layout=P.LayoutSpec(
            num_blocks=8, block_size_tokens=2, kv_layout="head_major")))
    with pytest.raises(LayoutError, match="layer outermost"):  # cross-layer: blocks span layers
        validate_registration(register(1, layout=P.LayoutSpec(
            num_blocks=8, block_size_tokens=2, kv_layout="BHLNC", head_layout="HND")))
    with pytest.raises(LayoutError, match="keeps heads NHD inside a page"):
        validate_registration(register(1, layout=P.LayoutSpec(
            num_blocks=8, block_size_tokens=2, kv_layout="LBNHC", head_layout="HND")))
    with pytest.raises(PlanError, match="24 SSM heads"):
        validate_registration(register(16))
    bad = msgspec.structs.replace(spec(), num_layers=7)
    with pytest.raises(PlanError, match="lists 8 layers"):
        validate_registration(register(1, model=bad))
    with pytest.raises(PlanError, match="no KV-cache group"):
        validate_registration(register(1, model=spec(groups=[[0, 4], [1, 5], [2, 7]])))


def test_block_id_lists_must_match_the_groups() -> None:
    hybrid.check_group_ids(spec(), [1, 2, 3, 4], [[1], [2], [3], [4]], "x")
    with pytest.raises(BlockIdError, match="one block-id list per KV-cache group"):
        hybrid.check_group_ids(spec(), [1, 2], None, "x")
    with pytest.raises(BlockIdError, match="3 block-id lists for a model of 4"):
        hybrid.check_group_ids(spec(), [1, 2, 3], [[1], [2], [3]], "x")
    with pytest.raises(BlockIdError, match="concatenation"):
        hybrid.check_group_ids(spec(), [1, 2, 3, 5], [[1], [2], [3], [4]], "x")
    plain = P.ModelSpec(name="m", num_kv_heads=2, num_layers=2, head_dim=4)
    with pytest.raises(BlockIdError, match="without groups"):
        hybrid.check_group_ids(plain, [1], [[1]], "x")


@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 1), (1, 4), (2, 4), (6, 4), (8, 2)])
def test_notices_add_up_to_the_plans_consumer_counts(p_tp: int, d_tp: int) -> None:
    """One count per (decode rank, prefill rank) pair, to the daemon hosting the prefill
    rank, whatever the groups; each pair's descriptors are the planner's, at the bases."""
    m = hybrid_geometry.hybrid_model(spec())
    p_par, d_par = Parallelism(p_tp), Parallelism(d_tp)
    plan = plan_hybrid(m, p_par, d_par)
    p_lay = hybrid_geometry.hybrid_rank_layout(spec(), HybridShape(p_tp).layout, p_par, 0)
    d_lay = hybrid_geometry.hybrid_rank_layout(spec(), HybridShape(d_tp).layout, d_par, 0)
    owner = {t: f"agent{t % 2}" for t in range(p_tp)}  # two producer daemons
    remote = {RankId(t): HybridRankPool(RankId(t), p_lay, 1 << 40 | t << 32, owner=owner[t])
              for t in range(p_tp)}
    local = [HybridRankPool(RankId(t), d_lay, 1 << 20 | t << 16) for t in range(d_tp)]
    d_ratio = next(g.blocks_per_logical for g in d_lay.groups if hasattr(g, "cache"))
    p_ratio = next(g.blocks_per_logical for g in p_lay.groups if hasattr(g, "cache"))
    tokens = 40
    n_l, n_r = -(-tokens // (2 * d_ratio)), -(-tokens // (2 * p_ratio))
    lids = [[0], list(range(1, 1 + n_l)), list(range(20, 20 + n_l)), [40]]
    rids = [[3], list(range(4, 4 + n_r)), list(range(24, 24 + n_r)), [44]]
    reads = assemble_hybrid_pull(plan, local, remote, lids, rids, tokens)
    for agent in set(owner.values()):
        want = sum(n for r, n in plan.consumers.items() if owner[r.tp_rank] == agent)
        assert reads[agent].reads == want
    total = 0
    for lr in local:
        for src in plan.sources(lr.rank):
            d = build_hybrid_descriptors(plan, lr.rank, src, d_lay, p_lay, lids, rids,
                                         tokens).merged()
            total += int(np.sum(d.nbytes))
    assert sum(g.total_nbytes for g in reads.values()) == total > 0
    empty = assemble_hybrid_pull(plan, local, remote, [[], [], [], []], rids, tokens,
                                 owners=["agent0", "agent1"])
    assert sum(g.reads for g in empty.values()) == sum(plan.consumers.values())
    assert all(g.descriptors == 0 for g in empty.values())
