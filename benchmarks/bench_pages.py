"""Page size vs speed: memcpy and raw NIXL READ on anon / 4 KiB shm / huge-page pools.

Run: .venv/bin/python benchmarks/bench_pages.py [--json] [--nbytes-mib 512] [--chunk-kib 32]
     [--repeats 5] [--rounds 1] [--shm-dir /dev/shm] [--huge-tmpfs-dir DIR] [--hugetlbfs-dir DIR]

hugetlbfs and memfd_hugetlb need 2 x nbytes of reserved 2 MiB pages
(`echo 600 > /proc/sys/vm/nr_hugepages` for 512 MiB); see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvd.tools.bench.pages import KINDS, bench_pages, render_pages

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--nbytes-mib", type=int, default=512)
    ap.add_argument("--chunk-kib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every kind N times, rotating the order (noisy boxes)")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--huge-tmpfs-dir", default=None, help="a tmpfs mounted huge=always")
    ap.add_argument("--hugetlbfs-dir", default=None, help="a hugetlbfs mount")
    a = ap.parse_args()
    res = bench_pages(nbytes_mib=a.nbytes_mib, chunk_kib=a.chunk_kib, repeats=a.repeats,
                      kinds=tuple(a.kinds.split(",")), shm_dir=a.shm_dir,
                      huge_tmpfs_dir=a.huge_tmpfs_dir, hugetlbfs_dir=a.hugetlbfs_dir,
                      rounds=a.rounds)
    print(json.dumps(res, indent=2) if a.json else render_pages(res))
    sys.exit(0 if all(r.get("verified", True) for r in res["kinds"]) else 1)
