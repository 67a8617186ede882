"""Mamba2 state: who holds which channels and heads, and the byte ranges that move them.

A Mamba2 layer keeps, per request slot, a conv state and an SSM (temporal)
state. The conv state covers the concatenation of three sub-projections,
x (num_heads * head_dim channels), B and C (n_groups * d_state channels
each), and vLLM shards each of them over TP separately: rank r's conv state
is [its x | its B | its C], not a contiguous slice of the global conv_dim.
The SSM state is (heads, head_dim, d_state), sharded over heads. So a decode
rank whose heads straddle prefill ranks reads, per layer and per prefill
rank it takes heads from, four byte ranges: its x, B and C slices and its SSM
head slice ("3 conv reads + 1 SSM read"). With the conv state dim-first (DS,
(conv_dim, state_len)) each slice is one run; state-first (SD,
(state_len, conv_dim), vLLM's default) costs one run per state step.

Ownership is derived, like topology.py does for KV heads, never asked of a
rank: heads [r*H/t, (r+1)*H/t) (vLLM requires H % t == 0); groups sharded the
same way when G % t == 0, else replicated, rank r holding group r*G//t (vLLM
runs G == 1 that way: every rank keeps the whole single group).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.errors import PlanError
from kvd.planner.plan import RankId
from kvd.planner.topology import Parallelism


@dataclass(frozen=True)
class MambaSpec:
    """The state geometry of a model's Mamba2 mixers (all Mamba layers share it)."""

    num_heads: int  # H: SSM heads; x channels and the SSM state are sharded over them
    head_dim: int  # P: x channels per head
    n_groups: int  # G: B and C have G * d_state channels each; 0: no B/C in the conv (Mamba1)
    d_state: int  # N
    conv_kernel: int  # the conv state keeps conv_kernel - 1 steps
    conv_dtype_nbytes: int = 2
    ssm_dtype_nbytes: int = 2

    @property
    def state_len(self) -> int:
        return self.conv_kernel - 1

    @property
    def x_channels(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_channels(self) -> int:
        """Channels of B (and of C): n_groups * d_state."""
        return self.n_groups * self.d_state

    @property
    def conv_channels(self) -> int:
        return self.x_channels + 2 * self.group_channels

    def validate(self) -> None:
        for name in ("num_heads", "head_dim", "d_state", "conv_dtype_nbytes",
                     "ssm_dtype_nbytes"):
            if getattr(self, name) < 1:
                raise PlanError(f"Mamba {name} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise PlanError(f"Mamba conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.n_groups < 0:
            raise PlanError(f"Mamba n_groups must be >= 0, got {self.n_groups}")
        if self.n_groups and self.num_heads % self.n_groups:
            raise PlanError(f"Mamba num_heads {self.num_heads} is not a multiple of n_groups "
                            f"{self.n_groups}: every head reads exactly one group")

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def check_mamba_tp(spec: MambaSpec, tp_size: int, role: str) -> None:
    """Refuse, naming the dimension, a TP size that cannot shard the Mamba state."""
    h, g, t = spec.num_heads, spec.n_groups, tp_size
    if h % t:
        raise PlanError(f"{role} TP {t} cannot shard {h} SSM heads (x channels and SSM state): "
                        f"needs {h} % {t} == 0")
    if g and g % t and t % g:
        raise PlanError(f"{role} TP {t} cannot shard {g} Mamba groups (B and C channels): "
                        f"needs {g} % {t} == 0 (sharded) or {t} % {g} == 0 (replicated)")


def mamba_rank_heads(spec: MambaSpec, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global SSM head range of a TP rank; its x channels are the same heads * head_dim."""
    per = spec.num_heads // tp_size
    return (tp_rank * per, (tp_rank + 1) * per)


def mamba_rank_groups(spec: MambaSpec, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global B/C group range of a TP rank: a shard, or the one group it replicates."""
    g, t = spec.n_groups, tp_size
    if g == 0:
        return (0, 0)
    if t <= g:
        return (tp_rank * g // t, (tp_rank + 1) * g // t)
    first = tp_rank * g // t
    return (first, first + 1)


def mamba_group_holders(spec: MambaSpec, tp_size: int, group: int) -> range:
    """TP ranks that hold a group: its owner when sharded, t/G replicas when replicated."""
    g, t = spec.n_groups, tp_size
    if t <= g:
        owner = group * t // g
        return range(owner, owner + 1)
    return range(group * t // g, (group + 1) * t // g)


@dataclass(frozen=True)
class MambaRankShape:
    """One rank's state shapes: conv (conv_channels, state_len), SSM (heads, head_dim, d_state)."""

    heads: int
    groups: int
    x_channels: int
    group_channels: int  # of B, and of C
    state_len: int
    head_dim: int
    d_state: int
    conv_dtype_nbytes: int
    ssm_dtype_nbytes: int

    @property
    def conv_channels(self) -> int:
        return self.x_channels + 2 * self.group_channels

    @property
    def conv_nbytes(self) -> int:
        return self.conv_channels * self.state_len * self.conv_dtype_nbytes

    @property
    def ssm_head_nbytes(self) -> int:
        return self.head_dim * self.d_state * self.ssm_dtype_nbytes

    @property
    def ssm_nbytes(self) -> int:
        return self.heads * self.ssm_head_nbytes

    @property
    def state_nbytes(self) -> int:
        """Conv plus SSM state of one layer and slot: what one rank must page per request."""
        return self.conv_nbytes + self.ssm_nbytes


def mamba_rank_shape(spec: MambaSpec, tp_size: int) -> MambaRankShape:
    check_mamba_tp(spec, tp_size, "engine")
    g0, g1 = mamba_rank_groups(spec, tp_size, 0)
    heads = spec.num_heads // tp_size
    return MambaRankShape(
        heads=heads, groups=g1 - g0, x_channels=heads * spec.head_dim,
        group_channels=(g1 - g0) * spec.d_state, state_len=spec.state_len,
        head_dim=spec.head_dim, d_state=spec.d_state,
        conv_dtype_nbytes=spec.conv_dtype_nbytes, ssm_dtype_nbytes=spec.ssm_dtype_nbytes,
    )


# ------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class MambaRead:
    """One decode rank's Mamba reads from one prefill rank, for every Mamba layer in `layers`.

    Like attention's Read, each range is given in three coordinate systems
    (global, inside the decode rank, inside the prefill rank). The heads give
    the x channels (heads * head_dim) and the SSM state rows; the groups give
    B and C. groups is None when this rank's groups come from another replica.
    """

    remote: RankId
    layers: tuple[int, int]  # global layer range; its Mamba layers move
    heads: tuple[int, int]
    local_heads: tuple[int, int]
    remote_heads: tuple[int, int]
    groups: tuple[int, int] | None = None
    local_groups: tuple[int, int] | None = None
    remote_groups: tuple[int, int] | None = None

    @property
    def reads_per_layer(self) -> int:
        """x + SSM, plus B and C where this rank serves the groups: the "3 + 1" reads."""
        return 4 if self.groups is not None else 2

    def to_json(self) -> dict:
        out = {"remote_tp_rank": self.remote.tp_rank, "remote_pp_rank": self.remote.pp_rank,
               "layers": list(self.layers), "heads": list(self.heads),
               "local_heads": list(self.local_heads), "remote_heads": list(self.remote_heads)}
        if self.groups is not None:
            out.update(groups=list(self.groups), local_groups=list(self.local_groups or ()),
                       remote_groups=list(self.remote_groups or ()))
        return out


def plan_mamba(spec: MambaSpec, prefill: Parallelism, decode: Parallelism,
               p_stages: list[tuple[int, int]], d_stages: list[tuple[int, int]],
               mamba_layers: tuple[int, ...]) -> dict[RankId, tuple[MambaRead, ...]]:
    """Every decode rank's Mamba reads, pp-major like plan_transfer.

    Heads are sharded on both sides, so each prefill rank a decode rank's heads
    overlap is read once per stage overlap. B/C groups always live on one of
    those ranks (a rank's heads all belong to the groups it holds), so taking
    them from there adds no producer; among replicas the least-loaded one
    serves (then lowest rank), spreading the load as plan_transfer does.
    """
    check_mamba_tp(spec, prefill.tp_size, "prefill")
    check_mamba_tp(spec, decode.tp_size, "decode")
    layer_set = np.asarray(mamba_layers, dtype=np.int64)
    load = {RankId(tp, pp): 0 for pp in range(len(p_stages)) for tp in range(prefill.tp_size)}
    p_heads = [mamba_rank_heads(spec, prefill.tp_size, p) for p in range(prefill.tp_size)]
    reads: dict[RankId, tuple[MambaRead, ...]] = {}
    for d_pp, (dl0, dl1) in enumerate(d_stages):
        overlaps = [
            (p_pp, max(dl0, pl0), min(dl1, pl1))
            for p_pp, (pl0, pl1) in enumerate(p_stages)
            if max(dl0, pl0) < min(dl1, pl1)
            and ((layer_set >= max(dl0, pl0)) & (layer_set < min(dl1, pl1))).any()
        ]
        for d_tp in range(decode.tp_size):
            h0, h1 = mamba_rank_heads(spec, decode.tp_size, d_tp)
            g0, g1 = mamba_rank_groups(spec, decode.tp_size, d_tp)
            out: list[MambaRead] = []
            for p_pp, l0, l1 in overlaps:
                sources = {p: (max(h0, ph0), min(h1, ph1), ph0)
                           for p, (ph0, ph1) in enumerate(p_heads) if max(h0, ph0) < min(h1, ph1)}
                served: dict[int, list[int]] = {}
                for g in range(g0, g1):
                    holders = [p for p in mamba_group_holders(spec, prefill.tp_size, g)
                               if p in sources]
                    if not holders:  # cannot happen: a rank's heads lie in the groups it holds
                        raise PlanError(f"internal: Mamba group {g} has no holder among the "
                                        f"prefill ranks decode rank {d_tp} reads heads from")
                    best = min(holders, key=lambda p, pp=p_pp: (load[RankId(p, pp)], p))
                    served.setdefault(best, []).append(g)
                    load[RankId(best, p_pp)] += 1
                for p, (a, b, ph0) in sources.items():
                    groups = local_groups = remote_groups = None
                    if p in served:
                        ga, gb = served[p][0], served[p][-1] + 1
                        if gb - ga != len(served[p]):
                            raise PlanError(f"internal: groups {served[p]} from one rank are "
                                            "not contiguous")
                        pg0 = mamba_rank_groups(spec, prefill.tp_size, p)[0]
                        groups, local_groups, remote_groups = \
                            (ga, gb), (ga - g0, gb - g0), (ga - pg0, gb - pg0)
                    out.append(MambaRead(
                        remote=RankId(p, p_pp), layers=(l0, l1), heads=(a, b),
                        local_heads=(a - h0, b - h0), remote_heads=(a - ph0, b - ph0),
                        groups=groups, local_groups=local_groups, remote_groups=remote_groups,
                    ))
            reads[RankId(d_tp, d_pp)] = tuple(out)
    return reads
