"""VRAM -> VRAM: kvd (two daemons, CUDA IPC pools) next to raw NIXL on GPU buffers.

One command on a GPU node (CUDA torch, nixl-cu12):

    .venv/bin/python benchmarks/bench_vram.py [--json] [--nbytes-mib 512] [--gpu 0]
        [--repeats 5] [--kv-layout kv_split]

UNTESTED ON A GPU (no GPU on the development machines). `--device cpu` runs the same
code on DRAM, which is how it was checked; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvd.errors import KvdError
from kvd.planner.layout import KV_LAYOUTS
from kvd.tools.bench.vram import render_vram, run_vram

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--nbytes-mib", type=int, default=512)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--gpu", type=int, default=0, help="GPU index both daemons use")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-layout", default="kv_split", choices=list(KV_LAYOUTS))
    a = ap.parse_args()
    try:
        res = run_vram(nbytes_mib=a.nbytes_mib, device=a.device, gpu=a.gpu, repeats=a.repeats,
                       kv_layout=a.kv_layout)
    except KvdError as exc:
        print(f"bench_vram: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(res, indent=2) if a.json else render_vram(res))
    sys.exit(0 if res["verified"] else 1)
