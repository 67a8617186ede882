"""Hybrid engines for the integration tests: a global hybrid state, rank shards, checks.

A request's whole state is, per KV-cache group, either attention KV
G[layer, kv, token, head, dim] or Mamba state (conv[layer, channel, step] in DS
layout with channels [x | B | C], ssm[layer, head, head_dim, d_state]); every
element is a distinct int32 >= 1, so a fresh (zero) pool shows any stray write.
A rank's shard follows vLLM's ownership rules, restated here from the model's
definition (x, B and C sharded separately; groups replicated past G ranks; KV
heads replicated past K); where the shard goes in the pool is the engine's own
layout (blocks_first pages, Mamba slots of `ratio` pages, [conv | ssm]). The
descriptor code of the planner is never used, so a pull checked against
``expected_pool`` checks the planner and the data path together.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.planner.hybrid.layout import (
    AttentionGroupLayout,
    HybridRankLayout,
    hybrid_head_layout,
    vllm_rank_layout,
)
from kvd.planner.hybrid.mamba import MambaSpec
from kvd.planner.hybrid.mamba_layout import MambaStateLayout
from kvd.planner.hybrid.plan import stage_ranges
from kvd.planner.topology import Parallelism
from kvd.wire.protocol import HybridSpec, LayerSpec, LayoutSpec, MambaSpecMsg, ModelSpec

PATTERN_KINDS = {"M": "mamba", "*": "attention", "S": "sliding", "-": "none"}


def hybrid_spec(pattern: str, groups: list[list[int]], *, k: int, head_dim: int,
                mamba: MambaSpecMsg, window: int, name: str = "itest-hybrid") -> ModelSpec:
    layers = [LayerSpec(PATTERN_KINDS[c], window if c == "S" else 0) for c in pattern]
    return ModelSpec(name=name, num_kv_heads=k, num_layers=len(pattern), head_dim=head_dim,
                     dtype="float32", hybrid=HybridSpec(layers=layers, groups=groups,
                                                        mamba=mamba))


@dataclass(frozen=True)
class HybridShape:
    tp_size: int
    pp_size: int = 1
    kernel_block_tokens: int = 2
    num_blocks: int = 48  # logical blocks (and Mamba slots)
    kv_layout: str = "blocks_first"  # or vLLM's LBHNC / LBNHC

    @property
    def layout(self) -> LayoutSpec:
        return LayoutSpec(num_blocks=self.num_blocks, block_size_tokens=self.kernel_block_tokens,
                          kv_layout=self.kv_layout,
                          head_layout=hybrid_head_layout(self.kv_layout))


def _kind(spec: ModelSpec, g: int) -> str:
    assert spec.hybrid is not None
    return spec.hybrid.layers[spec.hybrid.groups[g][0]].kind


def _mamba(spec: ModelSpec) -> MambaSpec:
    assert spec.hybrid is not None and spec.hybrid.mamba is not None
    m = spec.hybrid.mamba
    return MambaSpec(m.num_heads, m.head_dim, m.n_groups, m.d_state, m.conv_kernel, 4, 4)


def global_state(spec: ModelSpec, num_tokens_padded: int) -> dict[int, tuple[np.ndarray, ...]]:
    """Per group: (kv,) for attention groups, (conv, ssm) for Mamba groups."""
    assert spec.hybrid is not None
    out: dict[int, tuple[np.ndarray, ...]] = {}
    nxt = 1

    def block(*shape: int) -> np.ndarray:
        nonlocal nxt
        arr = np.arange(nxt, nxt + int(np.prod(shape)), dtype=np.int32).reshape(shape)
        nxt += arr.size
        return arr

    for g, layers in enumerate(spec.hybrid.groups):
        if _kind(spec, g) == "mamba":
            m = _mamba(spec)
            out[g] = (block(len(layers), m.conv_channels, m.state_len),
                      block(len(layers), m.num_heads, m.head_dim, m.d_state))
        else:
            out[g] = (block(len(layers), 2, num_tokens_padded, spec.num_kv_heads,
                            spec.head_dim),)
    return out


class Side:
    """One engine's geometry: layouts per PP stage, its ratio, its shards."""

    def __init__(self, spec: ModelSpec, shape: HybridShape) -> None:
        from kvd.pool.geometry import hybrid_model

        self.spec, self.shape = spec, shape
        self.model = hybrid_model(spec)
        self.par = Parallelism(shape.tp_size, shape.pp_size)
        self.stages = stage_ranges(self.model, self.par)
        self.layouts: dict[int, HybridRankLayout] = {
            pp: vllm_rank_layout(self.model, self.par, pp, shape.num_blocks,
                                 shape.kernel_block_tokens, kv_layout=shape.kv_layout)
            for pp in range(shape.pp_size)}
        self.ratio = next(g.blocks_per_logical for lay in self.layouts.values()
                          for g in lay.groups if isinstance(g, AttentionGroupLayout))

    @property
    def logical_tokens(self) -> int:
        return self.shape.kernel_block_tokens * self.ratio

    def positions(self, g: int, pp_rank: int) -> tuple[int, int]:
        a, b = self.stages[pp_rank]
        layers = self.model.groups[g].layers
        return sum(i < a for i in layers), sum(i < b for i in layers)

    def kv_heads(self, tp_rank: int) -> tuple[int, int]:
        k, t = self.spec.num_kv_heads, self.shape.tp_size
        if t <= k:
            return tp_rank * k // t, (tp_rank + 1) * k // t
        return tp_rank * k // t, tp_rank * k // t + 1

    def mamba_shard(self, tp_rank: int, conv: np.ndarray, ssm: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        m, t = _mamba(self.spec), self.shape.tp_size
        h0, h1 = tp_rank * m.num_heads // t, (tp_rank + 1) * m.num_heads // t
        g = m.n_groups
        g0, g1 = ((tp_rank * g // t, (tp_rank + 1) * g // t) if t <= g
                  else (tp_rank * g // t, tp_rank * g // t + 1))
        p, n = m.head_dim, m.d_state
        x_end, b_end = m.num_heads * p, m.num_heads * p + g * n
        body = np.concatenate([conv[h0 * p:h1 * p], conv[x_end + g0 * n:x_end + g1 * n],
                               conv[b_end + g0 * n:b_end + g1 * n]])
        return body, ssm[h0:h1]

    def write(self, pool: np.ndarray, tp_rank: int, pp_rank: int, g: int, ids: list[int],
              first_logical: int, t0: int, t1: int, state: dict[int, tuple[np.ndarray, ...]]
              ) -> None:
        """Put this rank's shard of group g (tokens [t0, t1) for attention) into ``pool``."""
        lay = self.layouts[pp_rank].groups[g]
        a, b = self.positions(g, pp_rank)
        if lay is None or a == b:
            return
        if isinstance(lay, MambaStateLayout):
            conv, ssm = state[g]
            for pos in range(a, b):
                body, heads = self.mamba_shard(tp_rank, conv[pos], ssm[pos])
                start = ((pos - a) * lay.layer_stride_nbytes + ids[0] * lay.slot_stride_nbytes) // 4
                pool[start:start + body.size] = body.reshape(-1)
                pool[start + body.size:start + body.size + heads.size] = heads.reshape(-1)
            return
        assert isinstance(lay, AttentionGroupLayout)
        (kv,) = state[g]
        shape = lay.cache.shape  # blocks_first: (layers, kernel blocks, kv, heads, tokens, dim)
        view = pool[:int(np.prod(shape))].reshape(shape)
        kbs, lt = self.shape.kernel_block_tokens, self.logical_tokens
        h0, h1 = self.kv_heads(tp_rank)
        for t in range(t0, t1):
            kernel = ids[t // lt - first_logical] * self.ratio + (t % lt) // kbs
            data = kv[a:b, :, t, h0:h1, :]  # [layer, kv, head, dim]
            if self.shape.kv_layout == "blocks_first":
                view[:, kernel, :, :, t % kbs, :] = data
            else:  # vLLM: K||V channels of one (head, token) side by side
                cat = data.transpose(0, 2, 1, 3).reshape(b - a, h1 - h0, -1)
                if self.shape.kv_layout == "LBHNC":
                    view[:, kernel, :, t % kbs, :] = cat
                else:  # LBNHC
                    view[:, kernel, t % kbs, :, :] = cat


def token_start(spec: ModelSpec, g: int, prod: Side, cons: Side, num_tokens: int,
                first_local: int) -> int:
    """First token group g moves to the decode (the definition, not the planner's code):
    after the decode's cached prefix, inside a sliding window, on whole kernel blocks."""
    if _kind(spec, g) == "mamba":
        return 0
    start = first_local * cons.logical_tokens
    if _kind(spec, g) == "sliding":
        assert spec.hybrid is not None
        start = max(start, num_tokens - spec.hybrid.layers[spec.hybrid.groups[g][0]]
                    .window_tokens + 1)
    start = min(start, num_tokens)
    big = max(prod.shape.kernel_block_tokens, cons.shape.kernel_block_tokens)
    return start // big * big if start < num_tokens else start
