"""Hybrid models: full attention, sliding-window attention and Mamba layers in one plan.

A hybrid model is a list of layers, each full attention, sliding-window
attention (window in tokens), Mamba, or without a cache (MLP/MoE layers still
count for PP partitions, so they stay in the list). Cache layers are grouped
into KV-cache groups as vLLM's hybrid allocator does: each group has its own
block table, so a request carries one block-id list per group. Everything two
engines must agree on is in `HybridModel` and its `compat_hash`; TP, PP and
block geometry may differ between the engines.

The plan is computed once per engine pair and reuses the attention planner:
attention reads are plan_transfer's over the whole layer list (heads are the
same on every attention layer), Mamba reads come from plan_mamba; the byte
layer (hybrid_layout.py) applies both to each group's layers.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvd.errors import PlanError
from kvd.planner.hybrid.mamba import MambaRead, MambaSpec, check_mamba_tp, plan_mamba
from kvd.planner.plan import RankId, Read, TransferPlan, plan_transfer
from kvd.planner.topology import (
    ModelGeometry,
    Parallelism,
    check_parallelism,
    head_holders,
    partition,
    rank_heads,
)

LAYER_KINDS = ("attention", "sliding", "mamba", "none")
TOKEN_KINDS = ("attention", "sliding")  # caches indexed by token: paged KV
# pattern letters (Nemotron-H's hybrid_override_pattern plus S for sliding window)
PATTERN_KINDS = {"M": "mamba", "*": "attention", "S": "sliding", "-": "none", "E": "none"}
HASH_SCHEMA = "kvd-hybrid-1"


@dataclass(frozen=True)
class AttentionSpec:
    """KV geometry shared by every attention layer (full and sliding) of the model."""

    num_kv_heads: int
    head_dim: int
    dtype_nbytes: int = 2
    mla: bool = False

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class Layer:
    kind: str  # one of LAYER_KINDS
    window_tokens: int = 0  # sliding only: the next token attends to the last window_tokens

    def to_json(self) -> dict:
        return {"kind": self.kind, **({"window_tokens": self.window_tokens}
                                      if self.kind == "sliding" else {})}


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: cache layers of one kind (and window) sharing a block table."""

    layers: tuple[int, ...]  # global layer indices, ascending


@dataclass(frozen=True)
class HybridModel:
    layers: tuple[Layer, ...]
    groups: tuple[KVGroup, ...]
    attention: AttentionSpec | None = None
    mamba: MambaSpec | None = None
    name: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layers_of(self, *kinds: str) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.kind in kinds)

    def group_kind(self, group: int) -> str:
        return self.layers[self.groups[group].layers[0]].kind

    def group_window(self, group: int) -> int:
        return self.layers[self.groups[group].layers[0]].window_tokens

    @property
    def geometry(self) -> ModelGeometry:
        """What plan_transfer needs: the attention heads over the whole layer list."""
        att = self.attention
        return ModelGeometry(num_kv_heads=att.num_kv_heads if att else 1,
                             num_layers=self.num_layers, mla=bool(att and att.mla))

    def validate(self) -> None:
        if not self.layers:
            raise PlanError("hybrid model needs at least 1 layer")
        for i, layer in enumerate(self.layers):
            if layer.kind not in LAYER_KINDS:
                raise PlanError(f"layer {i}: unknown kind {layer.kind!r}, expected one of "
                                f"{LAYER_KINDS}")
            if (layer.kind == "sliding") != (layer.window_tokens > 0):
                raise PlanError(f"layer {i}: window_tokens must be > 0 exactly for sliding "
                                f"layers, got {layer.kind} with {layer.window_tokens}")
        if self.layers_of(*TOKEN_KINDS):
            if self.attention is None:
                raise PlanError("model has attention layers but no attention spec")
            att = self.attention
            if min(att.num_kv_heads, att.head_dim, att.dtype_nbytes) < 1:
                raise PlanError(f"attention spec fields must be >= 1: {att}")
        if self.layers_of("mamba"):
            if self.mamba is None:
                raise PlanError("model has Mamba layers but no Mamba spec")
            self.mamba.validate()
        seen: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            ids = group.layers
            if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 \
                    or ids[-1] >= len(self.layers):
                raise PlanError(f"group {g}: layers {list(ids)} must be distinct, ascending and "
                                f"inside [0, {len(self.layers)})")
            first = self.layers[ids[0]]
            if first.kind == "none":
                raise PlanError(f"group {g}: layer {ids[0]} has no cache")
            for i in ids:
                if self.layers[i] != first:
                    raise PlanError(f"group {g}: layer {i} ({self.layers[i].kind}) does not match "
                                    f"the group's first layer ({first.kind}); a group holds cache "
                                    "layers of one kind and window")
                if i in seen:
                    raise PlanError(f"layer {i} is in groups {seen[i]} and {g}")
                seen[i] = g
        missing = [i for i, layer in enumerate(self.layers)
                   if layer.kind != "none" and i not in seen]
        if missing:
            raise PlanError(f"cache layers {missing} are in no KV-cache group")

    def to_json(self) -> dict:
        """The canonical description (the compat hash is over this, name included)."""
        return {
            "name": self.name,
            "layers": [layer.to_json() for layer in self.layers],
            "groups": [list(group.layers) for group in self.groups],
            "attention": self.attention.to_json() if self.attention else None,
            "mamba": self.mamba.to_json() if self.mamba else None,
        }


def vllm_groups(layers: tuple[Layer, ...]) -> tuple[KVGroup, ...]:
    """vLLM's uniform-page grouping: every group gets the same number of layers.

    Layers of one spec (kind, window) in model order, cut into groups of the
    fewest layers any spec has (or of the most, when that is within 1.25x of
    the fewest, to avoid many small groups); specs in order of first use.
    """
    by_spec: dict[Layer, list[int]] = {}
    for i, layer in enumerate(layers):
        if layer.kind != "none":
            by_spec.setdefault(layer, []).append(i)
    if not by_spec:
        return ()
    counts = [len(ids) for ids in by_spec.values()]
    size = max(counts) if max(counts) < min(counts) * 1.25 else min(counts)
    return tuple(KVGroup(tuple(ids[i:i + size])) for ids in by_spec.values()
                 for i in range(0, len(ids), size))


def model_from_pattern(pattern: str, *, attention: AttentionSpec | None = None,
                       mamba: MambaSpec | None = None, window_tokens: int = 0,
                       name: str = "", groups: tuple[KVGroup, ...] | None = None) -> HybridModel:
    """A model from a Nemotron-H style pattern: M Mamba, * attention, S sliding, - or E none."""
    bad = sorted(set(pattern) - set(PATTERN_KINDS))
    if bad:
        raise PlanError(f"pattern {pattern!r} has unknown letters {bad}; known: "
                        f"{''.join(PATTERN_KINDS)}")
    layers = tuple(Layer(PATTERN_KINDS[c], window_tokens if c == "S" else 0) for c in pattern)
    model = HybridModel(layers=layers, groups=groups if groups is not None else vllm_groups(layers),
                        attention=attention, mamba=mamba, name=name)
    model.validate()
    return model


def model_from_json(data: Mapping) -> HybridModel:
    """Parse `to_json` output, or the short form with "pattern" (and optional "window_tokens")."""
    try:
        att = AttentionSpec(**data["attention"]) if data.get("attention") else None
        mamba = MambaSpec(**data["mamba"]) if data.get("mamba") else None
        groups = (tuple(KVGroup(tuple(int(i) for i in g)) for g in data["groups"])
                  if data.get("groups") is not None else None)
        if "pattern" in data:
            return model_from_pattern(str(data["pattern"]), attention=att, mamba=mamba,
                                      window_tokens=int(data.get("window_tokens", 0)),
                                      name=str(data.get("name", "")), groups=groups)
        layers = tuple(Layer(str(x["kind"]), int(x.get("window_tokens", 0)))
                       for x in data["layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"bad hybrid model description: {exc!r}") from None
    model = HybridModel(layers=layers, groups=groups if groups is not None else vllm_groups(layers),
                        attention=att, mamba=mamba, name=str(data.get("name", "")))
    model.validate()
    return model


def compat_hash(model: HybridModel, *, kv_layout: str = "", conv_layout: str = "") -> str:
    """What two engines must share to exchange hybrid state: the whole model description.

    Layer kinds and windows, attention heads/dim/dtype/MLA, the Mamba state
    shapes and dtypes and the group structure (block-id lists pair by group
    index) all change it; TP, PP, block sizes and counts do not. Layout names
    are optional inputs because the descriptor builder refuses a mismatch anyway.
    """
    model.validate()
    text = json.dumps([HASH_SCHEMA, model.to_json(), kv_layout, conv_layout],
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------ plan


def stage_ranges(model: HybridModel, par: Parallelism) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for n in partition(model.geometry, par):
        ranges.append((start, start + n))
        start += n
    return ranges


@dataclass(frozen=True, eq=False)
class HybridPlan:
    """Attention and Mamba reads of every decode rank of one engine pair."""

    model: HybridModel
    prefill: Parallelism
    decode: Parallelism
    attention: Mapping[RankId, tuple[Read, ...]]  # reads whose layer range holds attention layers
    mamba: Mapping[RankId, tuple[MambaRead, ...]]
    # every prefill rank -> decode ranks that read anything from it: the daemon posts one
    # transfer per (decode rank, prefill rank) with all groups, so one notification each
    consumers: Mapping[RankId, int]

    def sources(self, decode_rank: RankId) -> tuple[RankId, ...]:
        """Prefill ranks this decode rank reads from (attention or Mamba), sorted pp-major."""
        ranks = {r.remote for r in self.attention[decode_rank]}
        ranks |= {r.remote for r in self.mamba[decode_rank]}
        return tuple(sorted(ranks, key=lambda r: (r.pp_rank, r.tp_rank)))

    @property
    def decode_ranks(self) -> tuple[RankId, ...]:
        return tuple(self.mamba)

    def to_json(self) -> dict:
        return {
            "model": self.model.to_json(),
            "compat_hash": compat_hash(self.model),
            "prefill": _par_json(self.model, self.prefill),
            "decode": _par_json(self.model, self.decode),
            "decode_ranks": [
                {"tp_rank": rank.tp_rank, "pp_rank": rank.pp_rank,
                 "sources": [r.key for r in self.sources(rank)],
                 "attention_reads": [r.to_json() for r in self.attention[rank]],
                 "mamba_reads": [r.to_json() for r in self.mamba[rank]]}
                for rank in self.decode_ranks
            ],
            "consumers": {rank.key: n for rank, n in self.consumers.items()},
        }


def _par_json(model: HybridModel, par: Parallelism) -> dict:
    return {"tp": par.tp_size, "pp": par.pp_size,
            "layer_partition": list(partition(model.geometry, par))}


def _holds(layers: tuple[int, ...], span: tuple[int, int]) -> bool:
    return any(span[0] <= i < span[1] for i in layers)


def _prefer_mamba_sources(geom: ModelGeometry, prefill: Parallelism,
                          attention: dict[RankId, tuple[Read, ...]],
                          mamba: Mapping[RankId, tuple[MambaRead, ...]]
                          ) -> dict[RankId, tuple[Read, ...]]:
    """Move replicated attention reads onto a replica the decode rank reads Mamba state from.

    plan_transfer balances replicas (MLA, K < TP) over the whole engine, which
    can send a decode rank to a prefill rank it has no other business with: one
    more transfer and notification. SSM heads never replicate, so the Mamba
    sources are fixed; among them the least-loaded holder serves.
    """
    cells: dict[RankId, int] = {}
    for reads in attention.values():
        for r in reads:
            cells[r.remote] = cells.get(r.remote, 0) + r.num_cells
    out = {}
    for rank, reads in attention.items():
        sources = {m.remote for m in mamba[rank]}
        moved = []
        for r in reads:
            holders = [RankId(tp, r.remote.pp_rank) for tp in head_holders(geom, prefill,
                                                                          r.heads[0])]
            choice = [h for h in holders if h in sources]
            if len(holders) > 1 and choice and r.remote not in sources:
                best = min(choice, key=lambda h: (cells.get(h, 0), h.tp_rank))
                cells[r.remote] -= r.num_cells
                cells[best] = cells.get(best, 0) + r.num_cells
                first = rank_heads(geom, prefill, best.tp_rank)[0]
                r = Read(best, r.heads, r.local_heads, (r.heads[0] - first, r.heads[1] - first),
                         r.layers)
            moved.append(r)
        out[rank] = tuple(moved)
    return out


@functools.lru_cache(maxsize=256)
def plan_hybrid(model: HybridModel, prefill: Parallelism, decode: Parallelism) -> HybridPlan:
    """Plan one engine pair; cached like plan_transfer (models are frozen and hashable).

    Refuses, naming the dimension, any TP the attention heads, SSM heads or
    Mamba groups cannot be split by; non-multiple TP pairs are fine whenever
    both sizes divide (intervals are intersected, as for attention heads).
    """
    model.validate()
    geom = model.geometry
    check_parallelism(geom, prefill, "prefill")
    check_parallelism(geom, decode, "decode")
    p_stages, d_stages = stage_ranges(model, prefill), stage_ranges(model, decode)
    d_ranks = [RankId(tp, pp) for pp in range(decode.pp_size) for tp in range(decode.tp_size)]

    att_layers = model.layers_of(*TOKEN_KINDS)
    attention: dict[RankId, tuple[Read, ...]] = {r: () for r in d_ranks}
    if att_layers:
        full: TransferPlan = plan_transfer(geom, prefill, decode)
        attention = {r: tuple(x for x in full.reads_for(r) if _holds(att_layers, x.layers))
                     for r in d_ranks}

    mamba_layers = model.layers_of("mamba")
    mamba: dict[RankId, tuple[MambaRead, ...]] = {r: () for r in d_ranks}
    if mamba_layers and model.mamba is not None:
        check_mamba_tp(model.mamba, prefill.tp_size, "prefill")
        check_mamba_tp(model.mamba, decode.tp_size, "decode")
        mamba = plan_mamba(model.mamba, prefill, decode, p_stages, d_stages, mamba_layers)
        attention = _prefer_mamba_sources(geom, prefill, attention, mamba)

    consumers = {RankId(tp, pp): 0 for pp in range(prefill.pp_size)
                 for tp in range(prefill.tp_size)}
    for r in d_ranks:
        for src in {x.remote for x in attention[r]} | {x.remote for x in mamba[r]}:
            consumers[src] += 1
    return HybridPlan(model=model, prefill=prefill, decode=decode,
                      attention=MappingProxyType(attention), mamba=MappingProxyType(mamba),
                      consumers=MappingProxyType(consumers))
