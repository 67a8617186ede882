"""Transfer benchmark: memcpy vs raw NIXL READ vs kvd end to end; see benchmarks/README.md.

Run: .venv/bin/python benchmarks/bench_transfer.py [--json] [--nbytes-mib 512] [--repeats 5]
     [--skip-hetero] [--kv-layout head_major] [--shm-dir /dev/shm]   (same as `kvd bench`)
"""

from __future__ import annotations

import argparse
import sys

from kvd.planner.layout import KV_LAYOUTS
from kvd.tools.bench import main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--nbytes-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-hetero", action="store_true")
    ap.add_argument("--kv-layout", default="kv_split",
                    choices=list(KV_LAYOUTS))
    ap.add_argument("--shm-dir", default="/dev/shm",
                    help="directory of the shm buffers and both daemons' pools")
    a = ap.parse_args()
    sys.exit(main(as_json=a.json, nbytes_mib=a.nbytes_mib, repeats=a.repeats,
                  skip_hetero=a.skip_hetero, kv_layout=a.kv_layout,
                  shm_dir=a.shm_dir))
