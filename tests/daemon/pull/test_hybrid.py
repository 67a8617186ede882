"""Hybrid models through real NIXL between two daemon processes, byte for byte.

Attention, sliding-window and Mamba groups move in one pull per request: each
case registers a prefill and a decode engine of the same hybrid model (own TP,
PP and kernel block size, hence own pages-per-logical-block ratio), writes the
global state's shards into the prefill pools (tests/support/hybrid_sim.py, from
the ownership rules, not the planner's offsets), publishes and pulls one
block-id list per group, and compares every decode pool with the expected one
in full: every byte that should move moved, and nothing else was written.
"""

from __future__ import annotations

import pytest
from support.cluster import deregister_and_check_freed, unique
from support.hybrid_cases import CASES, register, run_hybrid, spec
from support.hybrid_sim import HybridShape

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_byte_exact(pair, case: str) -> None:
    pshape, dshape, tokens, skip = CASES[case]
    recv, sent, bad = run_hybrid(pair, spec(), pshape, dshape, tokens, skip)
    assert recv.ok, recv.error
    assert recv.invalid_block_ids == [] and recv.invalid_group_block_ids == []
    assert recv.nbytes > 0
    assert bad == 0, f"{bad} decode elements differ from the expected pools"
    assert sent.ok, sent.error


def test_failed_hybrid_pull_reports_every_group(pair) -> None:
    """A request nobody published: the pull fails and names the local blocks per group."""
    m, shape = spec(), HybridShape(2)
    p, d = register(pair.pc, "hpre", m, shape), register(pair.dc, "hdec", m, shape)
    try:
        local = [[1], [2, 3], [4, 5], [6]]
        rid = unique("hmissing")
        pair.dc.pull(d.engine_id, rid, p.engine_id, pair.prefill.peer_address,
                     [[9], [10, 11], [12, 13], [14]], local, num_tokens=40)
        recv = pair.dc.wait(d.engine_id, rid, "done_recving", timeout_s=30)
        assert not recv.ok and recv.error.startswith("not_found")
        assert recv.invalid_group_block_ids == local
        assert sorted(recv.invalid_block_ids) == [1, 2, 3, 4, 5, 6]
    finally:
        deregister_and_check_freed(pair.pc, p)
        deregister_and_check_freed(pair.dc, d)


def test_hybrid_notify_only_pull_releases_the_producer(pair) -> None:
    """No local block in any group (everything cached): no byte moves, yet every pair's
    notice arrives and the producer ends the hold ok."""
    m, pshape, dshape = spec(), HybridShape(4), HybridShape(2)
    p, d = register(pair.pc, "hpre", m, pshape), register(pair.dc, "hdec", m, dshape)
    try:
        remote = [[1], [2, 3], [4, 5], [6]]
        rid = unique("hnotify")
        pair.pc.publish(p.engine_id, rid, remote)
        pair.dc.pull(d.engine_id, rid, p.engine_id, pair.prefill.peer_address, remote,
                     [[], [], [], []], num_tokens=40)
        recv = pair.dc.wait(d.engine_id, rid, "done_recving", timeout_s=30)
        sent = pair.pc.wait(p.engine_id, rid, "done_sending", timeout_s=30)
        assert recv.ok and recv.nbytes == 0, recv.error
        assert sent.ok, sent.error
    finally:
        deregister_and_check_freed(pair.pc, p)
        deregister_and_check_freed(pair.dc, d)
