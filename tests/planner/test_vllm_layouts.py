"""vLLM's layouts through two real `kvd serve` daemons and real NIXL, byte for byte.

The engines register the layout names exactly as vLLM spells them (LayoutSpec.kv_layout),
and kvd.tools.sim writes and checks the global KV pattern in each name's axis order, so this
checks registration, planning, descriptors and the data path against an oracle that
knows nothing of descriptors.
"""

from __future__ import annotations

import pytest
from support.cluster import run_transfer

from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl


def model(k: int = 8, layers: int = 4, head_dim: int = 64, mla: bool = False) -> ModelSpec:
    return ModelSpec(name="itest-vllm", num_kv_heads=k, num_layers=layers, head_dim=head_dim,
                     dtype="bfloat16", mla=mla)


def shape(layout: str, tp: int, pp: int = 1, bs: int = 16) -> EngineShape:
    return EngineShape(tp_size=tp, pp_size=pp, block_size_tokens=bs, num_blocks=40,
                       kv_layout=layout)


# id: (model, prefill shape, decode shape, tokens, skip_tokens)
CASES = {
    "LBHNC-tp1-tp2": (model(), shape("LBHNC", 1), shape("LBHNC", 2), 256, 0),
    "BHLNC-tp4-tp2": (model(), shape("BHLNC", 4), shape("BHLNC", 2), 256, 0),
    "LBNHC-tp1-tp2-per-token": (model(), shape("LBNHC", 1), shape("LBNHC", 2), 200, 0),
    "BLHNC-non-multiple-k24-6-4": (model(k=24, head_dim=32), shape("BLHNC", 6),
                                   shape("BLHNC", 4), 128, 0),
    "LHBNC-block-ratio-16-32": (model(), shape("LHBNC", 2, bs=16), shape("LHBNC", 1, bs=32),
                                200, 0),
    "BLNHC-tp2pp2-tp2-prefix-hit": (model(), shape("BLNHC", 2, pp=2), shape("BLNHC", 2),
                                    256, 160),
    "BLHNC-mla-2-3": (model(k=1, head_dim=96, mla=True), shape("BLHNC", 2), shape("BLHNC", 3),
                      256, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_layout_byte_exact(pair, case: str) -> None:
    m, pshape, dshape, tokens, skip = CASES[case]
    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, m, pshape, dshape, tokens,
                       skip_tokens=skip)
    assert res.recv.ok, res.recv.error
    assert res.recv.invalid_block_ids == []
    assert res.recv.nbytes > 0
    assert res.mismatches == 0
    assert res.stray == 0, "bytes landed outside the pulled blocks"
    assert res.sent.ok, res.sent.error
