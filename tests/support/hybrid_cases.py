"""Pulls of one hybrid model (attention, sliding-window and Mamba groups): the model,
registering its engines, one request prefill -> decode checked in full (`run_hybrid`),
and the shapes every hybrid pull test runs (tests/daemon/pull/test_hybrid.py and the
local, CUDA and same-host pull tests)."""

from __future__ import annotations

import random

import numpy as np

from kvd.client import KvdClient
from kvd.wire.protocol import Event, MambaSpecMsg, ModelSpec
from support.cluster import Engine, deregister_and_check_freed, unique
from support.hybrid_sim import HybridShape, Side, global_state, hybrid_spec, token_start

PATTERN = "M*S-M*MS"  # Mamba [0, 4] [6], attention [1, 5], sliding [2, 7]
GROUPS = [[0, 4], [1, 5], [2, 7], [6]]
MAMBA = MambaSpecMsg(num_heads=24, head_dim=2, n_groups=2, d_state=4, conv_kernel=4,
                     conv_dtype="float32", ssm_dtype="float32")


def spec(window: int = 7) -> ModelSpec:
    return hybrid_spec(PATTERN, GROUPS, k=2, head_dim=4, mamba=MAMBA, window=window)


def register(client: KvdClient, prefix: str, m: ModelSpec, shape: HybridShape) -> Engine:
    e = Engine(unique(prefix), m, None)  # type: ignore[arg-type]
    for p in range(shape.pp_size):
        for t in range(shape.tp_size):
            e.ranks.append(client.register(e.engine_id, m, shape.layout, t, shape.tp_size, p,
                                           shape.pp_size))
    return e


def run_hybrid(pair, m: ModelSpec, pshape: HybridShape, dshape: HybridShape, num_tokens: int,
               skip_logical: int = 0, seed: int = 5) -> tuple[Event, Event, int]:
    """One request prefill -> decode; (done_recving, done_sending, mismatching elements)."""
    prod, cons = Side(m, pshape), Side(m, dshape)
    p, d = register(pair.pc, "hpre", m, pshape), register(pair.dc, "hdec", m, dshape)
    try:
        rng = random.Random(seed)
        p_free = iter(rng.sample(range(pshape.num_blocks), pshape.num_blocks))
        d_free = iter(rng.sample(range(dshape.num_blocks), dshape.num_blocks))
        remote_ids, local_ids, first_local = [], [], []
        for g in range(len(GROUPS)):
            if prod.model.group_kind(g) == "mamba":
                remote_ids.append([next(p_free)])
                local_ids.append([next(d_free)])
                first_local.append(0)
                continue
            n_local = -(-num_tokens // cons.logical_tokens)
            remote_ids.append([next(p_free) for _ in range(-(-num_tokens //
                                                             prod.logical_tokens))])
            local_ids.append([next(d_free) for _ in range(n_local - skip_logical)])
            first_local.append(skip_logical)
        pkbs = pshape.kernel_block_tokens
        padded = -(-num_tokens // pkbs) * pkbs
        state = global_state(m, padded)
        for r in p.ranks:
            pool = r.kv.view(np.int32)
            for g in range(len(GROUPS)):
                prod.write(pool, r.tp_rank, r.pp_rank, g, remote_ids[g], 0, 0, padded, state)
        rid = unique("hreq")
        pair.pc.publish(p.engine_id, rid, remote_ids)
        pair.dc.pull(d.engine_id, rid, p.engine_id, pair.prefill.peer_address, remote_ids,
                     local_ids, num_tokens=num_tokens)
        recv = pair.dc.wait(d.engine_id, rid, "done_recving", timeout_s=30)
        sent = pair.pc.wait(p.engine_id, rid, "done_sending", timeout_s=30)
        small = min(pkbs, dshape.kernel_block_tokens)
        copy_end = -(-num_tokens // small) * small
        bad = 0
        for r in d.ranks:
            got = r.kv.view(np.int32)
            want = np.zeros_like(got)
            for g in range(len(GROUPS)):
                start = token_start(m, g, prod, cons, num_tokens, first_local[g])
                stop = copy_end if start < num_tokens else start
                cons.write(want, r.tp_rank, r.pp_rank, g, local_ids[g], first_local[g], start,
                           stop, state)
            bad += int(np.count_nonzero(got != want))
        return recv, sent, bad
    finally:
        deregister_and_check_freed(pair.pc, p)
        deregister_and_check_freed(pair.dc, d)


# id: (prefill shape, decode shape, tokens, decode prefix hit in logical blocks)
CASES = {
    "tp4-tp1": (HybridShape(4), HybridShape(1), 53, 0),
    "tp1-tp4": (HybridShape(1), HybridShape(4), 53, 0),
    "tp2-tp4": (HybridShape(2), HybridShape(4), 41, 0),
    "non-multiple-tp6-tp4": (HybridShape(6), HybridShape(4), 37, 0),
    "block-ratio-kbs2-kbs4-tp2-tp1": (HybridShape(2, kernel_block_tokens=2),
                                      HybridShape(1, kernel_block_tokens=4), 50, 0),
    "block-ratio-kbs4-kbs1-tp1-tp2": (HybridShape(1, kernel_block_tokens=4),
                                      HybridShape(2, kernel_block_tokens=1), 50, 0),
    "pp2-tp2-prefix-hit": (HybridShape(2, pp_size=2), HybridShape(2), 60, 1),
    # vLLM's page orders (K||V channels side by side), as the vLLM connector registers them
    "vllm-LBHNC-tp4-tp2": (HybridShape(4, kv_layout="LBHNC"), HybridShape(2, kv_layout="LBHNC"),
                           45, 0),
    "vllm-LBNHC-kbs2-kbs4-tp1-tp2": (HybridShape(1, kernel_block_tokens=2, kv_layout="LBNHC"),
                                     HybridShape(2, kernel_block_tokens=4, kv_layout="LBNHC"),
                                     50, 0),
}
