"""Engine side: per-group numpy views of a hybrid rank's flat pool.

A hybrid rank's pool is one flat region laid out as vLLM's hybrid allocator
does (kvd.planner.hybrid.layout.vllm_rank_layout). An engine that computes
into it needs each group as arrays: attention groups in the pool's kv_layout
([layer, kernel block, K|V, head, token, dim] for blocks_first, [layer,
kernel block, head, token, K||V channel] for vLLM's LBHNC), Mamba groups as conv
[layer, slot, ...conv shape] and SSM [layer, slot, head, head_dim, d_state].
The views are strided windows of the same bytes (groups share tensors, told
apart by block id), built from the same layout the daemon plans with, so
what the engine writes is what the daemon reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.planner.hybrid.layout import AttentionGroupLayout, vllm_rank_layout
from kvd.planner.hybrid.mamba import mamba_rank_shape
from kvd.planner.hybrid.mamba_layout import MambaStateLayout
from kvd.planner.hybrid.plan import HybridModel
from kvd.planner.topology import Parallelism

_INT_OF = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class MambaViews:
    conv: np.ndarray  # [layer, slot, conv_channels, state_len] (DS) or [.., state_len, channels]
    ssm: np.ndarray  # [layer, slot, heads, head_dim, d_state]


def _window(raw: np.ndarray, offset: int, itemsize: int, shape: tuple[int, ...],
            strides: tuple[int, ...]) -> np.ndarray:
    """A strided view of the pool's bytes (numpy checks it stays inside the pool)."""
    return np.ndarray(shape, dtype=_INT_OF[itemsize], buffer=raw, offset=offset,
                      strides=strides)


def group_views(pool: np.ndarray, model: HybridModel, par: Parallelism, pp_rank: int,
                num_blocks: int, kernel_block_tokens: int, conv_layout: str = "DS",
                kv_layout: str = "blocks_first") -> list[np.ndarray | MambaViews | None]:
    """One entry per model group (None: no layer of it on this PP stage); elements are
    unsigned ints of each part's dtype size (view them as the engine's dtype)."""
    raw = pool.reshape(-1).view(np.uint8)
    lay = vllm_rank_layout(model, par, pp_rank, num_blocks, kernel_block_tokens, conv_layout,
                           kv_layout)
    out: list[np.ndarray | MambaViews | None] = []
    for group in lay.groups:
        if isinstance(group, AttentionGroupLayout):
            cache = group.cache
            e = cache.dtype_nbytes
            shape = cache.shape
            strides = tuple(int(s) * e for s in np.cumprod((1, *shape[:0:-1]))[::-1])
            out.append(_window(raw, group.base_offset_nbytes, e, shape, strides))
        elif isinstance(group, MambaStateLayout):
            rs = mamba_rank_shape(group.spec, group.tp_size)
            m = group.spec
            ce, se = m.conv_dtype_nbytes, m.ssm_dtype_nbytes
            chans = rs.conv_channels
            inner = (chans, m.state_len) if conv_layout == "DS" else (m.state_len, chans)
            conv = _window(raw, group.base_offset_nbytes + group.conv_offset_nbytes, ce,
                           (group.num_layers, group.num_blocks, *inner),
                           (group.layer_stride, group.slot_stride, inner[1] * ce, ce))
            heads = rs.heads
            ssm = _window(raw, group.base_offset_nbytes + group.ssm_offset, se,
                          (group.num_layers, group.num_blocks, heads, m.head_dim, m.d_state),
                          (group.layer_stride, group.slot_stride, m.head_dim * m.d_state * se,
                           m.d_state * se, se))
            out.append(MambaViews(conv, ssm))
        else:
            out.append(None)
    return out
