"""Per-group views of a hybrid pool address the bytes the integration oracle writes."""

from __future__ import annotations

import numpy as np
import pytest
from support.hybrid_sim import HybridShape, Side, global_state, hybrid_spec

from kvd.pool.hybrid_views import MambaViews, group_views
from kvd.wire.protocol import MambaSpecMsg

MAMBA = MambaSpecMsg(num_heads=24, head_dim=2, n_groups=2, d_state=4, conv_kernel=4,
                     conv_dtype="float32", ssm_dtype="float32")
SPEC = hybrid_spec("M*S-M*MS", [[0, 4], [1, 5], [2, 7], [6]], k=2, head_dim=4, mamba=MAMBA,
                   window=7)


@pytest.mark.parametrize(("tp", "tp_rank", "kbs", "kv_layout"),
                         [(1, 0, 2, "blocks_first"), (4, 3, 1, "blocks_first"),
                          (6, 2, 4, "blocks_first"), (2, 1, 2, "LBHNC"), (4, 2, 4, "LBNHC")])
def test_views_match_the_oracles_placement(tp: int, tp_rank: int, kbs: int,
                                           kv_layout: str) -> None:
    shape = HybridShape(tp, kernel_block_tokens=kbs, num_blocks=12, kv_layout=kv_layout)
    side = Side(SPEC, shape)
    size = side.layouts[0].end_nbytes // 4 + 2
    tokens = 2 * side.logical_tokens
    state = global_state(SPEC, tokens)
    ids = [[3], [5, 1], [7, 2], [9]]
    want = np.zeros(size, dtype=np.int32)
    for g in range(4):
        side.write(want, tp_rank, 0, g, ids[g], 0, 0, tokens, state)
    got = np.zeros(size, dtype=np.int32)
    views = group_views(got, side.model, side.par, 0, shape.num_blocks, kbs,
                        kv_layout=kv_layout)
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
            data = kv[:, :, t, h0:h1, :]  # [layer, kv, head, dim]
            if kv_layout == "blocks_first":
                view[:, block, :, :, t % kbs, :] = data
            elif kv_layout == "LBHNC":  # [layer, block, head, token, K||V]
                view[:, block, :, t % kbs, :] = data.transpose(0, 2, 1, 3).reshape(
                    data.shape[0], h1 - h0, -1)
            else:  # LBNHC: [layer, block, token, head, K||V]
                view[:, block, t % kbs, :, :] = data.transpose(0, 2, 1, 3).reshape(
                    data.shape[0], h1 - h0, -1)
    np.testing.assert_array_equal(got, want)
