"""Byte-exact transfers through real NIXL between two daemon processes, over the shape matrix.

Each case uses fresh engine ids on one module-wide pair of daemons, checks every
decode rank against the global KV pattern (and that no other block was written),
the producer's done_sending, and that deregistering frees every pool.
"""

from __future__ import annotations

import pytest
from support.cluster import run_transfer

from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl


def model(k: int = 8, layers: int = 4, head_dim: int = 64, mla: bool = False) -> ModelSpec:
    return ModelSpec(name="itest-model", num_kv_heads=k, num_layers=layers, head_dim=head_dim,
                     dtype="bfloat16", mla=mla)


def shape(tp: int, pp: int = 1, bs: int = 16, blocks: int = 40, kv_layout: str = "kv_split",
          head_layout: str = "HND") -> EngineShape:
    return EngineShape(tp_size=tp, pp_size=pp, block_size_tokens=bs, num_blocks=blocks,
                       kv_layout=kv_layout, head_layout=head_layout)


# id: (model, prefill shape, decode shape, tokens, skip_tokens)
CASES = {
    "homogeneous-tp2-tp2": (model(), shape(2), shape(2), 256, 0),
    "decode-tp-larger-1-2": (model(), shape(1), shape(2), 256, 0),
    "decode-tp-larger-2-4": (model(), shape(2), shape(4), 256, 0),
    "prefill-tp-larger-4-2": (model(), shape(4), shape(2), 256, 0),
    "gqa-k2-1-4": (model(k=2), shape(1), shape(4), 256, 0),
    "gqa-k2-4-1": (model(k=2), shape(4), shape(1), 256, 0),
    "gqa-k2-4-8": (model(k=2), shape(4), shape(8), 256, 0),
    "mla-2-3": (model(k=1, head_dim=96, mla=True), shape(2), shape(3), 256, 0),
    "mla-4-1": (model(k=1, head_dim=96, mla=True), shape(4), shape(1), 256, 0),
    "non-multiple-k24-6-4": (model(k=24, head_dim=32), shape(6), shape(4), 128, 0),
    "non-multiple-k12-4-6": (model(k=12, head_dim=32), shape(4), shape(6), 128, 0),
    "pp2-pp1": (model(), shape(1, pp=2), shape(1), 256, 0),
    "tp2pp1-tp1pp3-10-layers": (model(layers=10), shape(2), shape(1, pp=3), 128, 0),
    "prefix-hit-tail-only": (model(), shape(2), shape(2), 256, 160),
    "block-ratio-16-32": (model(), shape(2, bs=16), shape(2, bs=32), 256, 0),
    "block-ratio-32-16": (model(), shape(2, bs=32), shape(2, bs=16), 256, 0),
    "block-ratio-16-32-partial-last": (model(), shape(1, bs=16), shape(2, bs=32), 200, 0),
    "block-ratio-16-32-prefix-hit": (model(), shape(2, bs=16), shape(1, bs=32), 256, 128),
    "block-ratio-32-16-prefix-hit": (model(), shape(1, bs=32), shape(2, bs=16), 256, 64),
    "blocks-first-2-1": (model(), shape(2, kv_layout="blocks_first"),
                         shape(1, kv_layout="blocks_first"), 256, 0),
    "blocks-first-1-2": (model(), shape(1, kv_layout="blocks_first"),
                         shape(2, kv_layout="blocks_first"), 256, 0),
    "cross-layer-2-2": (model(), shape(2, kv_layout="cross_layer"),
                        shape(2, kv_layout="cross_layer"), 256, 0),
    "cross-layer-2-1": (model(), shape(2, kv_layout="cross_layer"),
                        shape(1, kv_layout="cross_layer"), 256, 0),
    "head-major-1-2": (model(), shape(1, kv_layout="head_major"),
                       shape(2, kv_layout="head_major"), 256, 0),
    "head-major-2-2": (model(), shape(2, kv_layout="head_major"),
                       shape(2, kv_layout="head_major"), 256, 0),
    "head-major-4-2-pp2": (model(), shape(4, pp=2, kv_layout="head_major"),
                           shape(2, kv_layout="head_major"), 256, 0),
    "nhd-homogeneous-2-2": (model(), shape(2, head_layout="NHD"), shape(2, head_layout="NHD"),
                            256, 0),
}


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
