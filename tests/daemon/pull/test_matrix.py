"""Byte-exact transfers through real NIXL between two daemon processes, over the shape matrix.

Each case uses fresh engine ids on one module-wide pair of daemons, checks every
decode rank against the global KV pattern (and that no other block was written),
the producer's done_sending, and that deregistering frees every pool.
"""

from __future__ import annotations

import pytest
from support.cluster import run_transfer
from support.matrix_cases import CASES, model, shape

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("case", list(CASES))
def test_byte_exact(pair, case: str) -> None:
    m, pshape, dshape, tokens, skip = CASES[case]
    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, m, pshape, dshape, tokens,
                       skip_tokens=skip)
    assert res.recv.ok, res.recv.error
    assert res.recv.invalid_block_ids == []
    assert res.recv.nbytes > 0
    assert res.mismatches == 0
    assert res.stray == 0, "bytes landed outside the pulled blocks"
    assert res.sent.ok, res.sent.error


def test_prefix_hit_reads_only_the_tail(pair) -> None:
    """Fewer local blocks than remote: exactly the tail's bytes move."""
    m, full, part = model(), shape(1), shape(1)
    whole = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, m, full, full, 256)
    tail = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, m, full, part, 256,
                        skip_tokens=192)
    assert whole.recv.ok and tail.recv.ok
    assert tail.mismatches == 0 and tail.stray == 0
    assert len(tail.local_ids) == 4
    assert tail.recv.nbytes * 4 == whole.recv.nbytes


def test_zero_local_blocks_is_notify_only(pair) -> None:
    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, model(), shape(2), shape(1),
                       256, zero_local=True, timeout_s=10)
    assert res.recv.ok, res.recv.error
    assert res.recv.nbytes == 0
    assert res.sent.ok, f"producer not released by the notify-only pull: {res.sent.error}"
