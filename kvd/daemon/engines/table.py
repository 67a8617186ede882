"""Registered engine ranks and the pools kvd owns for them: pure bookkeeping.

A rank's life is an explicit state machine:

    LIVE --deregister / silent past engine_timeout_s / stop--> RETIRED
    RETIRED --last unpin, collected--> FREEING --deregistered, unlinked--> FREED

A pool is freed only when both hold: its rank is gone (RETIRED) and no transfer
pins it. Pins are taken by in-flight consumer READs (local writes) and by
published requests from publish until they end (remote reads). The async part
(allocation, NIXL registration, freeing) is kvd.daemon.engines.registry.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from kvd.daemon.transitions import step
from kvd.errors import (
    BlockIdError,
    IncompatibleError,
    KvdError,
    LayoutError,
    NotFoundError,
    PlanError,
)
from kvd.planner import (
    CacheLayout,
    ModelGeometry,
    Parallelism,
    RankId,
    TransferPlan,
    check_parallelism,
    plan_transfer,
)
from kvd.planner.layout import HEAD_LAYOUTS
from kvd.pool.base import Pool
from kvd.pool.geometry import (
    HybridPool,
    geometry,
    hybrid_compat,
    hybrid_rank_pool,
    parallelism,
    rank_layout,
)
from kvd.wire.protocol import (
    AUTO_KV_LAYOUT,
    DRAM_DEVICE_INDEX,
    DTYPE_NBYTES,
    EngineDesc,
    LayoutSpec,
    ModelSpec,
    RankDesc,
    RegisterEngine,
)

_epochs = itertools.count(1)

# What LayoutSpec.kv_layout "auto" becomes (auto_kv_layout), per (kind of model, head
# order). Descriptor counts per layout: the table in docs/engine-api.md.
AUTO_LAYOUTS = {
    # Plain attention. HND: head_major, one descriptor per block homogeneous and per block
    # per read across TP sizes. NHD: head_major exists only as HND, and NHD bodies cannot
    # be head-sliced at all (docs/planner.md, NHD policy), so the fastest NHD layout for
    # the pairs NHD serves, whole-head reads: cross_layer, one descriptor per block.
    ("attention", "HND"): "head_major",
    ("attention", "NHD"): "cross_layer",
    # MLA: one latent head replicated on every rank, reads are always whole-head, and
    # cross_layer is one descriptor per block for any TP and PP pair (head_major is the
    # same bytes with one head, but HND only).
    ("mla", "HND"): "cross_layer",
    ("mla", "NHD"): "cross_layer",
    # Hybrid (Mamba) pools refuse orders whose blocks span layers (HYBRID_KV_LAYOUTS).
    # LBHNC keeps a rank's head range of a (layer, block) one run, also across TP sizes
    # (blocks_first splits it into K and V runs); NHD pages: LBNHC, the only NHD one.
    ("hybrid", "HND"): "LBHNC",
    ("hybrid", "NHD"): "LBNHC",
}


def auto_kv_layout(model: ModelSpec, head_layout: str) -> str:
    """The concrete kv_layout "auto" means for an engine of ``model`` whose kernels keep
    ``head_layout`` bodies: the one with the fewest descriptors that they allow.

    A function of the model's kind and the head order alone, never of TP, PP or block
    size: two daemons resolve any two engines that may pair to the same name, so the
    compatibility hash (which includes it) matches.
    """
    if head_layout not in HEAD_LAYOUTS:
        raise LayoutError(f"unknown head_layout {head_layout!r}, expected one of {HEAD_LAYOUTS}")
    kind = "hybrid" if model.hybrid is not None else "mla" if model.mla else "attention"
    return AUTO_LAYOUTS[kind, head_layout]


def resolve_layout(model: ModelSpec, layout: LayoutSpec) -> LayoutSpec:
    """``layout`` with "auto" replaced by its concrete kv_layout (else unchanged)."""
    if layout.kv_layout != AUTO_KV_LAYOUT:
        return layout
    return msgspec.structs.replace(layout,
                                   kv_layout=auto_kv_layout(model, layout.head_layout))


def resolve_registration(msg: RegisterEngine) -> RegisterEngine:
    """The registration as the daemon keeps it: its layout concrete (resolve_layout)."""
    layout = resolve_layout(msg.model, msg.layout)
    return msg if layout is msg.layout else msgspec.structs.replace(msg, layout=layout)


def compat_hash(model: ModelSpec, layout: LayoutSpec) -> str:
    """What two engines must share to exchange KV (not TP, PP or block size/count)."""
    if layout.kv_layout == AUTO_KV_LAYOUT:  # a daemon resolves it before anyone compares
        raise LayoutError("kv_layout 'auto' must be resolved by the engine's own daemon at "
                          "registration; a peer never sends it")
    key = (f"{model.name}|{model.num_kv_heads}|{model.num_layers}|{model.head_dim}|"
           f"{model.dtype}|{model.mla}|{layout.kv_layout}|{layout.head_layout}")
    if model.hybrid is not None:  # layers, groups, Mamba shapes (hybrid.plan.compat_hash)
        key += f"|hybrid:{hybrid_compat(model, layout)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]




class PlanCache:
    """Transfer plans per (model, prefill parallelism, decode parallelism), bounded:
    engines come and go, a long-lived daemon must not keep every pairing forever."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._plans: dict[tuple[ModelGeometry, Parallelism, Parallelism], TransferPlan] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, model: ModelGeometry, prefill: Parallelism, decode: Parallelism
            ) -> tuple[TransferPlan, bool]:
        """(plan, True if it was cached)."""
        key = (model, prefill, decode)
        plan = self._plans.get(key)
        if plan is not None:
            return plan, True
        if len(self._plans) >= self.max_entries:
            self._plans.clear()
        plan = self._plans[key] = plan_transfer(model, prefill, decode)
        return plan, False


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> None:
    """Refuse negative or out-of-range block ids, naming them (code ``bad_block_ids``)."""
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise BlockIdError(f"{what} block ids {bad[:8]}{' ...' if len(bad) > 8 else ''} out of "
                           f"range [0, {num_blocks})")


class RankState(enum.Enum):
    LIVE = "live"
    RETIRED = "retired"  # gone: serves nothing new; its pool waits for the last unpin
    # retired while its engine lived on (silent, its connection closed) and still maps
    # the pool: kept, for that engine to take back when it registers again (adopt_pool)
    DORMANT = "dormant"
    FREEING = "freeing"  # unpinned: being deregistered from NIXL and unlinked
    FREED = "freed"


class RankOn(enum.Enum):
    """What happened to an engine rank."""

    GONE = "gone"  # deregistered, silent past engine_timeout_s, connections closed
    KEPT = "kept"  # unpinned, revivable, and its engine still maps the pool
    COLLECT = "collect"  # unpinned: its pool may be freed now
    TAKEN_BACK = "taken_back"  # its engine registered again naming the pool: a new rank owns it
    FREED = "freed"  # deregistered from NIXL, unmapped, unlinked


_R = RankState
RANK_TRANSITIONS: dict[RankState, dict[RankOn, RankState]] = {
    _R.LIVE: {RankOn.GONE: _R.RETIRED},
    _R.RETIRED: {RankOn.KEPT: _R.DORMANT, RankOn.COLLECT: _R.FREEING},
    _R.DORMANT: {RankOn.KEPT: _R.DORMANT, RankOn.COLLECT: _R.FREEING,
                 RankOn.TAKEN_BACK: _R.FREED},
    _R.FREEING: {RankOn.FREED: _R.FREED},
    _R.FREED: {},
}


def next_rank_state(state: RankState, event: RankOn) -> RankState:
    """Raises kvd.daemon.transitions.BadTransition for a move the table does not list."""
    return step(RANK_TRANSITIONS, state, event, "a rank")


@dataclass
class EngineRank:
    engine_id: str
    rank: RankId
    msg: RegisterEngine
    cache: CacheLayout | HybridPool  # hybrid engines: every group's layout (kvd.pool.geometry)
    first_layer: int
    pool: Pool  # ShmPool or CudaPool
    reg_id: int
    last_seen_s: float
    pins: int = 0
    state: RankState = RankState.LIVE
    device_id: int = 0  # GPU index for VRAM pools
    revivable: bool = False  # retired without the engine saying so: it may come back

    @property
    def gone(self) -> bool:
        return self.state is not RankState.LIVE

    def to(self, event: RankOn) -> None:
        """The one place a rank's state changes: a row of RANK_TRANSITIONS."""
        self.state = next_rank_state(self.state, event)


@dataclass
class Engine:
    """All ranks of one engine hosted on this daemon, plus the shared geometry."""

    engine_id: str
    model: ModelSpec
    layout: LayoutSpec
    par: Parallelism
    engine_daemons: list[str]
    ranks: dict[RankId, EngineRank] = field(default_factory=dict)
    epoch: int = 0
    mem_type: str = "DRAM"

    @functools.cached_property
    def compat(self) -> str:  # model and layout are fixed at registration
        return compat_hash(self.model, self.layout)

    def desc(self) -> EngineDesc:
        return EngineDesc(
            engine_id=self.engine_id, model=self.model, layout=self.layout,
            tp_size=self.par.tp_size, pp_size=self.par.pp_size,
            layer_partition=list(self.par.layer_partition) if self.par.layer_partition else None,
            ranks=[RankDesc(tp_rank=r.rank.tp_rank, pp_rank=r.rank.pp_rank, base_addr=r.pool.addr,
                            nbytes=r.pool.nbytes, num_blocks=r.cache.num_blocks,
                            device_id=r.device_id)
                   for r in self.live_ranks()],
            mem_type=self.mem_type,
            epoch=self.epoch,
        )

    def live_ranks(self) -> list[EngineRank]:
        return [r for _, r in sorted(self.ranks.items())]

    def missing_ranks(self, own_address: str) -> list[RankId]:
        """Ranks not registered here, when no other daemon may host them (an engine whose
        engine_daemons name another daemon is complete only across daemons: not checked)."""
        if any(a != own_address for a in self.engine_daemons):
            return []
        if len(self.ranks) >= self.par.tp_size * self.par.pp_size:
            return []
        # Stops at the first few: the full rank set is never enumerated (it is bounded by
        # check_parallelism, but a pull waiting on an incomplete engine polls this often).
        missing: list[RankId] = []
        for p in range(self.par.pp_size):
            for t in range(self.par.tp_size):
                if RankId(t, p) not in self.ranks:
                    missing.append(RankId(t, p))
                    if len(missing) >= MISSING_RANKS_SHOWN:
                        return missing
        return missing


MISSING_RANKS_SHOWN = 16


def validate_registration(msg: RegisterEngine
                          ) -> tuple[Parallelism, CacheLayout | HybridPool, int]:
    """Everything about a registration that can be refused before allocating memory.

    ``msg.layout`` may still say "auto": the pool is sized by its resolved layout (the
    registry stores ``resolve_registration(msg)``)."""
    msg = resolve_registration(msg)
    if not msg.engine_id or len(msg.engine_id) > 256:
        raise KvdError("engine_id must be 1..256 characters")
    if msg.model.dtype not in DTYPE_NBYTES:
        raise KvdError(f"unsupported dtype {msg.model.dtype!r}; known: {sorted(DTYPE_NBYTES)}")
    if msg.model.head_dim < 1 or msg.model.num_layers < 1 or msg.model.num_kv_heads < 1:
        raise KvdError("model head_dim, num_layers and num_kv_heads must be >= 1")
    par = parallelism(msg.tp_size, msg.pp_size, msg.layer_partition)
    check_parallelism(geometry(msg.model), par, "engine")
    if msg.device_index < DRAM_DEVICE_INDEX:
        raise KvdError(f"device_index {msg.device_index}: a GPU index >= 0, or "
                       f"{DRAM_DEVICE_INDEX} for a DRAM pool")
    if not (0 <= msg.tp_rank < msg.tp_size and 0 <= msg.pp_rank < msg.pp_size):
        raise PlanError(f"rank {msg.tp_rank}/{msg.pp_rank} outside TP {msg.tp_size} x PP "
                        f"{msg.pp_size}")
    if msg.model.hybrid is not None:
        pool, first = hybrid_rank_pool(msg.model, msg.layout, par, msg.pp_rank)
        return par, pool, first
    cache, first = rank_layout(msg.model, msg.layout, par, msg.pp_rank)
    return par, cache, first


class EngineTable:
    """Live ranks per engine, plus retired ranks whose pools still wait for their last unpin."""

    def __init__(self, max_ranks: int) -> None:
        self.engines: dict[str, Engine] = {}
        self.retired: list[EngineRank] = []
        self.max_ranks = max_ranks

    def rank_count(self) -> int:
        return sum(len(e.ranks) for e in self.engines.values())

    def get(self, engine_id: str) -> Engine:
        engine = self.engines.get(engine_id)
        if engine is None or not engine.ranks:
            raise NotFoundError(f"engine {engine_id!r} is not registered on this daemon")
        return engine

    def check_joinable(self, msg: RegisterEngine, par: Parallelism) -> Engine | None:
        """Refuse a rank whose geometry disagrees with ranks already registered."""
        engine = self.engines.get(msg.engine_id)
        rank = RankId(msg.tp_rank, msg.pp_rank)
        if engine is None or not engine.ranks:
            return None
        if (engine.model, engine.layout, engine.par) != (msg.model, msg.layout, par):
            raise IncompatibleError(
                f"engine {msg.engine_id!r} rank {rank.key} disagrees with its other ranks on "
                "model, layout or parallelism"
            )
        if rank in engine.ranks:
            raise KvdError(f"engine {msg.engine_id!r} rank {rank.key} is already registered")
        return engine

    def add(self, msg: RegisterEngine, par: Parallelism, rank: EngineRank,
            mem_type: str) -> Engine:
        engine = self.engines.get(msg.engine_id)
        if engine is None or not engine.ranks:
            engine = Engine(engine_id=msg.engine_id, model=msg.model, layout=msg.layout, par=par,
                            engine_daemons=list(msg.engine_daemons), mem_type=mem_type)
            self.engines[msg.engine_id] = engine
        engine.ranks[rank.rank] = rank
        engine.epoch = next(_epochs)
        return engine

    def mark_gone(self, engine_id: str, rank: RankId) -> EngineRank | None:
        """Retire a rank: it stops serving at once; its pool is freed once unpinned."""
        engine = self.engines.get(engine_id)
        if engine is None or rank not in engine.ranks:
            return None
        gone = engine.ranks.pop(rank)
        gone.to(RankOn.GONE)
        self.retired.append(gone)
        engine.epoch = next(_epochs)
        return gone

    def rank_ids(self, engine_id: str) -> set[RankId]:
        """Ranks a consumer may have planned against: live and retired-but-pinned."""
        engine = self.engines.get(engine_id)
        live = set(engine.ranks) if engine else set()
        return live | {r.rank for r in self.retired if r.engine_id == engine_id}

    def collectable(self, keep: Callable[[EngineRank], bool] = lambda _: False
                    ) -> list[EngineRank]:
        """Retired, unpinned ranks, now FREEING: their pools may be freed. They stay on the
        retired list until ``freed()``, so an interrupted collection loses nothing. A
        revivable one that ``keep`` says its engine still maps is DORMANT instead (asked
        again at every collection)."""
        out = []
        for r in self.retired:
            if r.pins or r.state not in (RankState.RETIRED, RankState.DORMANT):
                continue
            if r.revivable and keep(r):
                r.to(RankOn.KEPT)
                continue
            r.to(RankOn.COLLECT)
            out.append(r)
        return out

    def dormant(self, engine_id: str, rank: RankId, pool_name: str) -> EngineRank | None:
        """The DORMANT rank whose pool an engine asks to take back, if it is one."""
        for r in self.retired:
            if (r.state is RankState.DORMANT and r.engine_id == engine_id and r.rank == rank
                    and r.pool.name == pool_name):
                return r
        return None

    def freed(self, rank: EngineRank) -> None:
        """Its pool freed (FREEING), or taken back by a new registration (DORMANT)."""
        rank.to(RankOn.FREED if rank.state is RankState.FREEING else RankOn.TAKEN_BACK)
        self.retired = [r for r in self.retired if r is not rank]
        busy = {r.engine_id for r in self.retired}
        engine = self.engines.get(rank.engine_id)
        if engine is not None and not engine.ranks and rank.engine_id not in busy:
            del self.engines[rank.engine_id]
