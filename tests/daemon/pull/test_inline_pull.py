"""A small pull in the engine's request itself, through real NIXL between
daemon processes: its READ is posted inline before the Acquire's reply, and it is
reported in the same step when both are in. The bytes count only once the Acquire
confirms: refused after the READ was posted, the pull fails with every local block
invalid, never ok."""

from __future__ import annotations

import pytest
from support.cluster import Pair, metric, unique

from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

# 64 KiB blocks: small pulls.
MODEL = ModelSpec(name="pull-now-model", num_kv_heads=4, num_layers=4, head_dim=64)
SHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=32)


def _engines(pair: Pair):
    pe, de = unique("pn-pre"), unique("pn-dec")
    pr = pair.pc.register(pe, MODEL, layout_spec(SHAPE), 0, 1)
    dr = pair.dc.register(de, MODEL, layout_spec(SHAPE), 0, 1)
    return pe, de, pr, dr


def _pull(pair: Pair, pe: str, de: str, rid: str, remote: list[int], local: list[int],
          receipt: str = ""):
    return pair.dc.pull_and_wait(de, rid, pe, pair.prefill.peer_address, remote, local,
                                 publish_receipt=receipt, timeout_s=30)


def _warm(pair: Pair, pe: str, de: str) -> None:
    """One pull: the handshake is cached after it, so the next ones take the short path."""
    rid = unique("warm")
    receipt = pair.pc.publish(pe, rid, [0])
    assert _pull(pair, pe, de, rid, [0], [0], receipt).ok
    assert pair.pc.wait(pe, rid, "done_sending", timeout_s=10).ok


def test_small_pulls_in_the_request_are_byte_exact(pair: Pair) -> None:
    pe, de, pr, dr = _engines(pair)
    try:
        _warm(pair, pe, de)
        cases = [([1], [2]), ([7], [3]), ([4, 9], [10, 11]), ([31], [30]),
                 ([0, 1, 2, 3], [20, 21, 22, 23])]
        for i, (src, dst) in enumerate(cases):
            g = global_kv(MODEL, len(src) * SHAPE.block_size_tokens, seed=11 + i)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, src)
            rid = unique(f"pn{i}")
            receipt = pair.pc.publish(pe, rid, src)
            ev = _pull(pair, pe, de, rid, src, dst, receipt if i % 2 == 0 else "")
            assert ev.ok, ev.error
            assert pair.pc.wait(pe, rid, "done_sending", timeout_s=10).ok
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, dst) == 0, (src, dst)
        assert pair.dc.status().pulls == []
    finally:
        pair.pc.deregister(pr)
        pair.dc.deregister(dr)


@pytest.mark.parametrize("refusal", ["at_once", "after_waiting"])
def test_an_acquire_refused_after_the_read_was_posted_fails_the_pull(
        pair: Pair, refusal: str) -> None:
    """at_once: the producer refuses at once (blocks it never published), while or just
    after the READ runs; after_waiting: a request it never published, refused after it
    waited for the Publish (about a second), long after the READ ended. Either way the
    READ was posted before the refusal, and the pull must fail."""
    pe, de, pr, dr = _engines(pair)
    try:
        _warm(pair, pe, de)
        g = global_kv(MODEL, SHAPE.block_size_tokens, seed=3)
        write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [5])
        rid = unique("refused")
        if refusal == "at_once":
            pair.pc.publish(pe, rid, [6])  # not block 5: the Acquire names unpublished blocks
        posted = metric(pair.decode, "kvd_descriptors_posted_total")
        ev = _pull(pair, pe, de, rid, [5], [9])
        assert not ev.ok, "a refused Acquire must never report ok"
        assert ev.invalid_block_ids == [9]
        code = "bad_block_ids" if refusal == "at_once" else "not_found"
        assert ev.error.startswith(code), ev.error
        # the READ went out before the refusal came: the bytes were there, and not trusted
        assert metric(pair.decode, "kvd_descriptors_posted_total") > posted
        assert pair.dc.status().pulls == []
        # the daemon goes on: the next pull of the same blocks is ok and byte-exact
        rid2 = unique("after")
        receipt = pair.pc.publish(pe, rid2, [5])
        assert _pull(pair, pe, de, rid2, [5], [9], receipt).ok
        assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [9]) == 0
    finally:
        pair.pc.deregister(pr)
        pair.dc.deregister(dr)
