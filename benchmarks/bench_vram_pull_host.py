"""Host work per local VRAM pull, on CPU (not a test): what the planner, the assembly and
the CUDA copier cost the daemon per pull, with pulls handed over as block ids
(kvd.planner.blocks) against the descriptors they expand to.

    flock /tmp/kvd-cpu.lock .venv/bin/python benchmarks/bench_vram_pull_host.py [--json]

1. Assembly (`PreparedPull.assemble`) of a 1 GiB pull of `kvd bench`'s geometry, random
   block ids, for four pool layouts, TP1 -> TP1 and TP1 -> TP2: ``blocks=True`` (what a
   VRAM -> VRAM pull asks for) against the descriptors (what every pull built before).
2. The CUDA copier's host CPU time per post (the posting thread's ``thread_time``) over
   the simulated GPU of tests/support/sim_gpu.py, which runs nothing (addresses point
   nowhere): 1 GiB as 512 blocks of 1, 16 and 128 pieces (512, 8,192 and 65,536 pieces),
   ``post_blocks`` against ``post`` of the expanded descriptors.
Medians; the best of a few runs for the assembly. On a GPU the copier's figures come
from scripts/gpu_check_local_copy.py (docs/notes/2026-11-28-vram-block-copies.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1 << 30
LAYOUTS = ("kv_split", "head_major", "cross_layer", "blocks_first")


def assembly(repeats: int = 7) -> list[dict]:
    from kvd.planner import RankId, plan_transfer
    from kvd.planner.assembly import RankPool, match_tail, prepare_pull
    from kvd.pool.geometry import geometry, parallelism, rank_layout
    from kvd.tools.bench.geometry import Geometry, layout_spec

    rows = []
    for layout in LAYOUTS:
        geom = Geometry(kv_layout=layout)
        blocks = GIB // geom.block_nbytes
        pool = blocks + blocks // 4
        model = geom.model()
        for ptp, dtp in ((1, 1), (1, 2)):
            lpar, rpar = parallelism(dtp, 1, None), parallelism(ptp, 1, None)
            plan = plan_transfer(geometry(model), rpar, lpar)
            lc, lf = rank_layout(model, layout_spec(geom.shape(dtp, pool)), lpar, 0)
            rc, rf = rank_layout(model, layout_spec(geom.shape(ptp, pool)), rpar, 0)
            local = [RankPool(RankId(t, 0), lc, lf, (1 << 40) + t * lc.total_nbytes)
                     for t in range(dtp)]
            remote = {RankId(t, 0): RankPool(RankId(t, 0), rc, rf,
                                             (1 << 41) + t * rc.total_nbytes, owner="p")
                      for t in range(ptp)}
            prepared = prepare_pull(plan, local, remote, ["p"])
            rng = random.Random(7)
            lo, ro = match_tail(rng.sample(range(pool), blocks), rng.sample(range(pool), blocks),
                                geom.block_size_tokens, geom.block_size_tokens)
            row = {"layout": layout, "tp": f"{ptp}->{dtp}"}
            for label, as_blocks in (("descriptors", False), ("blocks", True)):
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    g = prepared.assemble(lo, ro, blocks=as_blocks)["p"]
                    ts.append(time.perf_counter() - t0)
                row[f"{label}_us"] = round(min(ts) * 1e6, 1)
            row["descriptors"] = g.descriptors
            row["table_rows"] = len(g.blocks.table) if g.blocks is not None else None
            rows.append(row)
    return rows


def copier(repeats: int = 25, blocks: int = 512) -> list[dict]:
    from kvd.planner.blocks import BlockCopy, BlockTable
    from kvd.transport.copies.cudacopy import CudaCopier
    from tests.support.sim_gpu import SimGpu

    out = []
    pool = blocks * 5 // 4
    for per_block in (1, 16, 128):
        seg = GIB // blocks // per_block
        j = np.arange(per_block, dtype=np.int64)
        table = BlockTable((1 << 40) + j * pool * seg, (1 << 41) + j * pool * seg,
                           np.full(per_block, seg), np.full(per_block, seg),
                           np.full(per_block, seg), 0, 0, pool, pool)
        gpu = SimGpu(kernels=True, dry=True, devices=1)
        row: dict = {"pieces": blocks * per_block, "piece_nbytes": seg}
        with CudaCopier(streams_per_device=1, _runtime=(gpu, gpu)) as c:
            c.wait_kernels(10)
            rng = np.random.default_rng(per_block)
            for label, n in (("post_blocks", repeats), ("post_expanded", max(3, repeats // 5))):
                ts = []
                for i in range(n + 1):
                    bc = BlockCopy(table, rng.permutation(pool)[:blocks],
                                   rng.permutation(pool)[:blocks])
                    t0 = time.thread_time()
                    if label == "post_blocks":
                        h = c.post_blocks(bc)
                    else:
                        d, s, nb, _, _ = bc.expand()
                        h = c.post(d, s, nb, dst_devs=0, src_devs=0)
                    if i:
                        ts.append(time.thread_time() - t0)
                    c.wait(h, 10)
                    c.release(h)
                row[f"{label}_us"] = round(statistics.median(ts) * 1e6, 1)
        out.append(row)
    posts = [r["post_blocks_us"] for r in out]
    out.append({"post_blocks_max_over_min": round(max(posts) / min(posts), 2)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = {"assembly_1GiB": assembly(), "copier_host_1GiB_sim": copier()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("assembly of a 1 GiB pull (best of 7), us: descriptors -> blocks")
    for r in result["assembly_1GiB"]:
        print(f"  {r['layout']:12s} TP{r['tp']}: {r['descriptors']:6d} descriptors "
              f"{r['descriptors_us']:8.1f} -> {r['blocks_us']:6.1f}  (table rows "
              f"{r['table_rows']})")
    print("CUDA copier, host CPU per post (simulated GPU, median), us")
    for r in result["copier_host_1GiB_sim"]:
        if "pieces" in r:
            print(f"  {r['pieces']:6d} pieces of {r['piece_nbytes'] >> 10:5d} KiB: "
                  f"post_blocks {r['post_blocks_us']:8.1f}   expanded post "
                  f"{r['post_expanded_us']:9.1f}")
        else:
            print(f"  post_blocks max/min: {r['post_blocks_max_over_min']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
