"""Per-group views of a hybrid pool address the bytes the integration oracle writes."""

from __future__ import annotations

import numpy as np
import pytest
from support.hybrid_sim import HybridShape, Side, global_state, hybrid_spec

from kvd.hybrid_views import MambaViews, group_views
from kvd.protocol import MambaSpecMsg

MAMBA = MambaSpecMsg(num_heads=24, head_dim=2, n_groups=2, d_state=4, conv_kernel=4,
                     conv_dtype="float32", ssm_dtype="float32")
SPEC = hybrid_spec("M*S-M*MS", [[0, 4], [1, 5], [2, 7], [6]], k=2, head_dim=4, mamba=MAMBA,
                   window=7)


@pytest.mark.parametrize(("tp", "tp_rank", "kbs"), [(1, 0, 2), (4, 3, 1), (6, 2, 4)])
def test_views_match_the_oracles_placement(tp: int, tp_rank: int, kbs: int) -> None:
    shape = HybridShape(tp, kernel_block_tokens=kbs, num_blocks=12)
    side = Side(SPEC, shape)
    size = side.layouts[0].end_nbytes // 4 + 2
    tokens = 2 * side.logical_tokens
    state = global_state(SPEC, tokens)
    ids = [[3], [5, 1], [7, 2], [9]]
    want = np.zeros(size, dtype=np.int32)
    for g in range(4):
        side.write(want, tp_rank, 0, g, ids[g], 0, 0, tokens, state)
    got = np.zeros(size, dtype=np.int32)
    views = group_views(got, side.model, side.par, 0, shape.num_blocks, kbs)
    h0, h1 = side.kv_heads(tp_rank)
    for g, view in enumerate(views):
        if isinstance(view, MambaViews):
            conv, ssm = state[g]
            for pos in range(conv.shape[0]):
                body, heads = side.mamba_shard(tp_rank, conv[pos], ssm[pos])
                view.conv[pos, ids[g][0]] = body
                view.ssm[pos, ids[g][0]] = heads
            continue
        assert view is not None
        (kv,) = state[g]
        for t in range(tokens):
            block = ids[g][t // side.logical_tokens] * side.ratio + \
                (t % side.logical_tokens) // kbs
            view[:, block, :, :, t % kbs, :] = kv[:, :, t, h0:h1, :]
    np.testing.assert_array_equal(got, want)
