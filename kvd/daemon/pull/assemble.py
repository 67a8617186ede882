"""A pull's descriptors: the planner's reads applied to both sides' pools.

`PullAssembler` is what the driver calls for the `Assemble` action: it checks the pair
(compatible, the engine still here), takes the remote blocks that feed the local ones
(`match_tail`: the tail on a prefix hit), and applies the cached plan to both sides'
rank pools (kvd.planner.assembly), grouped by producer daemon. Its inputs are bound once
per (engine, peer engine) in a `PreparedPull` and reused while the handshake and the
engine's epoch stay the same.
"""

from __future__ import annotations

from kvd.daemon import hybrid
from kvd.daemon.engines.table import Engine, PlanCache
from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.pull.hostmap import host_bases
from kvd.daemon.pull.machine import Pull
from kvd.errors import IncompatibleError, KvdError
from kvd.ops.metrics import Metrics
from kvd.planner import Parallelism, RankId
from kvd.planner.assembly import (
    PreparedPull,
    ProducerReads,
    RankPool,
    match_tail,
    prepare_pull,
)
from kvd.pool.geometry import geometry, parallelism, rank_layout

MAX_PREPARED = 256  # (engine, peer engine) pairs kept ready; cleared past it
# A sample pull's blocks, on both sides: non-adjacent (no two merge into one descriptor)
# with gaps of 2 and 3, so the gcd of their offsets is that of any pull's (the block
# stride's and the layers' offsets'): its descriptors need the chunk every pull does
# (kvd.transport.remote.prepped.common_chunk).
SAMPLE_BLOCK_IDS = (1, 3, 6)


class PullAssembler:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.plans = PlanCache()
        # (engine, peer engine) -> (prepared assembly, the handshake, the engine and its
        # epoch: both change with every rank that registers or leaves)
        self._ready: dict[tuple[str, str], tuple[PreparedPull, RemoteEngine, Engine, int]] = {}

    def __call__(self, pull: Pull, engine: Engine, remote: RemoteEngine
                 ) -> dict[str, ProducerReads]:
        """The pull's descriptors, grouped by producer (kvd.planner.assembly)."""
        msg = pull.msg
        if remote.compat != engine.compat:
            raise IncompatibleError(
                f"engine {msg.remote_engine_id!r} is incompatible with {msg.engine_id!r} "
                f"(model/dtype/layout differ: {remote.desc.model} {remote.desc.layout})")
        if not engine.live_ranks():
            raise KvdError(f"engine {msg.engine_id!r} left before its READs were posted")
        if engine.model.hybrid is not None:  # every KV-cache group, Mamba state included
            return hybrid.assemble_pull(engine, remote, msg, host_bases(remote))
        local_ids, remote_ids = match_tail(
            msg.local_block_ids, msg.remote_block_ids, engine.layout.block_size_tokens,
            remote.desc.layout.block_size_tokens, msg.num_tokens)
        return self._assemble(engine, remote, local_ids, remote_ids)

    def _assemble(self, engine: Engine, remote: RemoteEngine, local_ids, remote_ids
                  ) -> dict[str, ProducerReads]:
        # VRAM to VRAM: also as block ids over tables prepared once per pair, which the
        # CUDA copier takes without descriptors (kvd.planner.blocks)
        blocks = engine.mem_type == "VRAM" and remote.desc.mem_type == "VRAM"
        return self._prepared(engine, remote).assemble(local_ids, remote_ids, blocks)

    def prepare(self, engine: Engine, remote: RemoteEngine) -> None:
        """Plan and prepare the pair's assembly now, ahead of its first pull."""
        if engine.model.hybrid is None and remote.compat == engine.compat:
            self._prepared(engine, remote)

    def sample(self, engine: Engine, remote: RemoteEngine) -> dict[str, ProducerReads] | None:
        """The reads of a pull of `SAMPLE_BLOCK_IDS` on both sides, for what the pair's
        pulls would prepare on their first post (NIXL lists of their chunk); None where
        a sample does not stand for them (hybrid models, block sizes that differ, pools
        too small)."""
        n = max(SAMPLE_BLOCK_IDS) + 1
        if (engine.model.hybrid is not None or remote.compat != engine.compat
                or engine.layout.block_size_tokens != remote.desc.layout.block_size_tokens
                or engine.layout.num_blocks < n
                or any(rr.desc.num_blocks < n for rr in remote.ranks.values())):
            return None
        return self._prepared(engine, remote).assemble(SAMPLE_BLOCK_IDS, SAMPLE_BLOCK_IDS)

    def _prepared(self, engine: Engine, remote: RemoteEngine) -> PreparedPull:
        """The assembly's inputs, bound once per (engine, peer engine) and reused while
        they stay the same: the local pools and geometry (the engine's epoch changes
        with every rank that registers or leaves) and the handshake (identity: a new one
        is a new object): a small pull would otherwise rebuild them every time."""
        key = (engine.engine_id, remote.desc.engine_id)
        hit = self._ready.get(key)
        m = self.metrics
        if (hit is not None and hit[1] is remote and hit[2] is engine
                and hit[3] == engine.epoch):
            m.plan_cache_hits.inc()
            return hit[0]
        local = tuple(RankPool(r.rank, r.cache, r.first_layer, r.pool.addr, r.device_id)
                      for r in engine.live_ranks())
        owners = tuple(d.agent for d in remote.daemons.values())
        rpar, remote_pools = self._remote_pools(remote)
        plan, cached = self.plans.get(geometry(engine.model), rpar, engine.par)
        (m.plan_cache_hits if cached else m.plan_cache_misses).inc()
        prepared = prepare_pull(plan, local, remote_pools, owners)
        if len(self._ready) >= MAX_PREPARED:
            self._ready.clear()
        self._ready[key] = (prepared, remote, engine, engine.epoch)
        return prepared

    @staticmethod
    def _remote_pools(remote: RemoteEngine) -> tuple[Parallelism, dict[RankId, RankPool]]:
        """The remote engine's parallelism and rank pools, built once per handshake (on
        the host path, at the addresses its pool files are mapped at here)."""
        if remote.pools is None:
            rdesc = remote.desc
            rpar = parallelism(rdesc.tp_size, rdesc.pp_size, rdesc.layer_partition)
            bases = host_bases(remote)
            pools = {}
            for rid, rr in remote.ranks.items():
                cache, first = rank_layout(rdesc.model, rdesc.layout, rpar, rid.pp_rank,
                                           rr.desc.num_blocks)
                pools[rid] = RankPool(rid, cache, first, bases.get(rid, rr.desc.base_addr),
                                      rr.desc.device_id, owner=rr.agent)
            remote.pools = (rpar, pools)
        return remote.pools

