"""Scale curves: kvd throughput vs request size and vs concurrent pulls, next to the ceilings.

Run: .venv/bin/python benchmarks/bench_curves.py [--json] [--plot curves.png]
     [--max-mib 1024] [--conc-mib 32] [--concurrency 1,2,4,8,16,32,64] [--repeats 5]
     [--kv-layout kv_split] [--shm-dir /dev/shm]

--plot needs matplotlib (pip install 'kvd[plot]'). About 2-3 minutes and ~4 GiB of
pools at the defaults; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys

from kvd.errors import KvdError
from kvd.planner.layout import KV_LAYOUTS
from kvd.tools.bench.curves import CONCURRENCY, MAX_MIB, main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--plot", default=None, metavar="FILE", help="draw both curves to a PNG")
    ap.add_argument("--max-mib", type=int, default=MAX_MIB, help="largest request (MiB)")
    ap.add_argument("--conc-mib", type=int, default=32, help="size of each concurrent pull")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-layout", default="kv_split", choices=list(KV_LAYOUTS))
    ap.add_argument("--shm-dir", default="/dev/shm")
    a = ap.parse_args()
    try:
        sys.exit(main(as_json=a.json, max_mib=a.max_mib, repeats=a.repeats,
                      conc_mib=a.conc_mib,
                      concurrency=tuple(int(c) for c in a.concurrency.split(",")),
                      kv_layout=a.kv_layout, shm_dir=a.shm_dir, plot_path=a.plot))
    except KvdError as exc:
        print(f"bench_curves: error: {exc}", file=sys.stderr)
        sys.exit(2)
