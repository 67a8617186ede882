"""`kvd bench`: memcpy vs raw NIXL vs kvd end to end, same machine, same bytes.

One run measures, in this order (so that buffers of one phase are freed before
the next one allocates; peak is ~2 GiB at the default 512 MiB):

1. memcpy (``raw.bench_memcpy``): one numpy copy of ``nbytes`` between two
   preallocated, pre-faulted buffers (median and best of several). The single-core
   ceiling.
2. raw NIXL READ (``raw.bench_nixl``): two agents in two spawned processes, DRAM,
   progress thread off, buffers pre-faulted; the target polls ``get_new_notifs``
   continuously. Each descriptor set is warmed once (connection setup, page faults),
   then timed from building the transfer to DONE (median). Sets: one big descriptor
   (the best NIXL can do) and exactly the descriptors kvd builds for each scenario
   (``geometry.kvd_descriptors``: kvd's own ceiling).
3. kvd (``e2e.bench_kvd``): two ``kvd serve`` processes (prefill node, decode node),
   simulated engines registered with ``KvdClient``, a request of ``nbytes`` published
   on the prefill side and pulled by the decode side; timed at the client from
   ``publish`` to the ``done_recving`` event (median of fresh request ids reusing the
   same blocks, after one warm-up pull that does the handshake and faults pages).
   Block ids are a random sample of a pool 1.25x the request (realistic, fragmented
   cache); consecutive ids (kvd's best case: the descriptors merge) are measured too
   and reported as ``kvd_gbps_consecutive``. Data are checked byte for byte after the
   warm-up and once more at the end.
4. 1-block pull latency: many sequential pulls of a 1-block request (pull call to
   ``done_recving`` at the client), p50/p99.
5. local (``local.bench_local``): both engines on ONE daemon, so a pull is a copy in
   that daemon (no network): each scenario's throughput as a ratio to a single-thread
   memcpy timed alternately with it, per copy-thread count, and the 1-block local pull
   against the 1-block pull between two daemons, alternating. JSON key ``local``.

Every "shm" buffer (memcpy shm, raw NIXL shm) and both daemons' pools live in
``shm_dir`` (/dev/shm by default; a huge-page mount to measure huge-page pools).
``report`` assembles the JSON and renders the table.

Geometry: a Llama-3-8B-like cache (32 layers, 8 KV heads, head_dim 128,
bf16, 16-token blocks, HND; ``kv_layout`` head_major by default, or any of
``KV_LAYOUTS``, the same on both engines) = 128 KiB per token, 2 MiB per
block; 512 MiB is a 4096-token request. With kv_split a random-block request
is 16,384 descriptors of 32 KiB; with cross_layer it is 256 descriptors of
2 MiB (one per block). The hetero (TP1 -> TP2) pull is 32,768 descriptors of
16 KiB with either; with head_major it is 256 of 1 MiB per decode rank.
"""

from __future__ import annotations

import functools
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.bench.e2e import bench_kvd
from kvd.tools.bench.floor import FloorPipeline
from kvd.tools.bench.geometry import (
    DEFAULT_KV_LAYOUT,
    DEFAULT_SHM_DIR,
    HETERO,
    HETERO_4TO2,
    HOMOGENEOUS,
    TARGET_P50_MS,
    TARGET_RATIO_KVD_MEMCPY,
    Geometry,
    MiB,
    Scenario,
    kvd_descriptors,
)
from kvd.tools.bench.local import (
    LOCAL_TP1_TP1,
    LOCAL_TP1_TP2,
    LOCAL_TP4_TP2,
    bench_local,
    local_verified,
    render_local,
)
from kvd.tools.bench.raw import DescSet, RawStream, bench_memcpy, bench_nixl
from kvd.tools.bench.report import build_result, machine_info, render

__all__ = [
    "DEFAULT_SHM_DIR", "HETERO", "HETERO_4TO2", "HOMOGENEOUS", "TARGET_P50_MS",
    "TARGET_RATIO_KVD_MEMCPY",
    "Geometry", "MiB", "Scenario", "bench_kvd", "bench_memcpy", "bench_nixl",
    "kvd_descriptors", "machine_info", "main", "render", "run_bench",
]


def _check_shm_dir(shm_dir: str) -> None:
    from kvd.errors import KvdError

    if not Path(shm_dir).is_absolute() or not Path(shm_dir).is_dir():
        raise KvdError(f"shm_dir: {shm_dir!r} is not an existing absolute directory")


def run_bench(nbytes_mib: int = 512, repeats: int = 5, skip_hetero: bool = False,
              latency_pulls: int = 200, seed: int = 7, kv_layout: str = DEFAULT_KV_LAYOUT,
              shm_dir: str = DEFAULT_SHM_DIR, posting_workers: str = "auto",
              concurrent_pulls: int = 16) -> dict[str, Any]:
    _check_shm_dir(shm_dir)
    started = time.perf_counter()
    machine = machine_info(shm_dir)
    geom = Geometry(kv_layout=kv_layout)
    blocks = max(1, nbytes_mib * MiB // geom.block_nbytes)
    nbytes = blocks * geom.block_nbytes
    pool_blocks = blocks + max(1, blocks // 4)
    rng = random.Random(seed)
    p_ids = rng.sample(range(pool_blocks), blocks)
    d_ids = rng.sample(range(pool_blocks), blocks)
    scenarios = [HOMOGENEOUS] if skip_hetero else [HOMOGENEOUS, HETERO, HETERO_4TO2]

    memcpy = bench_memcpy(nbytes, repeats, shm_dir)

    sets: list[DescSet] = []
    one = np.array([0], dtype=np.int64)
    whole = np.array([nbytes], dtype=np.int64)
    sets.append(("single", "anon", one, one.copy(), whole))
    sets.append(("single:shm", "shm", one, one.copy(), whole))
    ndesc: dict[str, int] = {}
    desc_nbytes: dict[str, int] = {}
    local_max = remote_max = nbytes
    for scn in scenarios:
        lo, ro, nb, lbytes, rbytes = kvd_descriptors(geom, scn, pool_blocks, pool_blocks,
                                                     p_ids, d_ids)
        assert int(nb.sum()) == nbytes, (scn, int(nb.sum()), nbytes)
        sets.append((scn.name, "anon", lo, ro, nb))
        sets.append((scn.name + ":shm", "shm", lo, ro, nb))
        ndesc[scn.name] = len(nb)
        desc_nbytes[scn.name] = int(np.median(nb))
        local_max, remote_max = max(local_max, lbytes), max(remote_max, rbytes)
        _, _, cnb, _, _ = kvd_descriptors(geom, scn, pool_blocks, pool_blocks,
                                          list(range(blocks)), list(range(blocks)))
        ndesc[scn.name + ":consecutive"] = len(cnb)
    nixl = bench_nixl(local_max, remote_max, sets, repeats, check_set="single", shm_dir=shm_dir)
    if not nixl.get("verified"):
        raise RuntimeError("raw NIXL READ did not deliver the expected bytes")

    logs = Path(tempfile.mkdtemp(prefix="kvd-bench-"))
    # The best single stream again, timed between kvd's repeats (the target's ratio): a
    # baseline from a minute earlier saw other background load than kvd did.
    raw = RawStream(nbytes, shm_dir)
    try:
        kvd = bench_kvd(geom, scenarios, blocks, pool_blocks, p_ids, d_ids, repeats,
                        latency_pulls, logs, shm_dir=shm_dir,
                        concurrent_pulls=concurrent_pulls,
                        daemon_args=("--set", f"posting_workers={posting_workers}"), raw=raw,
                        floor=functools.partial(FloorPipeline, geom.block_nbytes, shm_dir))
    finally:
        nixl["stream_verified"] = raw.close()
    if not nixl["stream_verified"]:
        raise RuntimeError("the raw NIXL stream did not deliver the expected bytes")
    machine["posting_workers"] = posting_workers
    machine["posting_workers_used"] = max(1, len(kvd.get("rails", [])))
    local_scenarios = ((LOCAL_TP1_TP1,) if skip_hetero
                       else (LOCAL_TP1_TP1, LOCAL_TP1_TP2, LOCAL_TP4_TP2))
    local = bench_local(geom, blocks, pool_blocks, p_ids, d_ids, repeats, latency_pulls, logs,
                        shm_dir=shm_dir, scenarios=local_scenarios)
    result = build_result(geom, scenarios, nbytes, repeats, memcpy, nixl, kvd, ndesc,
                          desc_nbytes, machine, logs, started)
    result["local"] = local
    return result


def main(as_json: bool = False, nbytes_mib: int = 512, repeats: int = 5,
         skip_hetero: bool = False, kv_layout: str = DEFAULT_KV_LAYOUT,
         shm_dir: str = DEFAULT_SHM_DIR, posting_workers: str = "auto") -> int:
    result = run_bench(nbytes_mib=nbytes_mib, repeats=repeats, skip_hetero=skip_hetero,
                       kv_layout=kv_layout, shm_dir=shm_dir, posting_workers=posting_workers)
    print(json.dumps(result, indent=2) if as_json
          else render(result) + "\n\n" + render_local(result["local"]))
    return 0 if (all(s["verified"] and s.get("verified_consecutive") is not False
                     for s in result["scenarios"])
                 and local_verified(result["local"])) else 1
