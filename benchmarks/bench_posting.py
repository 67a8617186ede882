"""Posting cost per descriptor: prepared lists vs a fresh list per READ (kvd's Transport).

Run: .venv/bin/python benchmarks/bench_posting.py [--json] [--nbytes-mib 512]
     [--chunks-kib 4,32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys

from kvd.tools.bench.posting import bench_posting, render_posting

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--nbytes-mib", type=int, default=512)
    ap.add_argument("--chunks-kib", default="4,32", help="chunk sizes, comma separated")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    res = bench_posting(nbytes_mib=a.nbytes_mib,
                        chunks_kib=tuple(int(c) for c in a.chunks_kib.split(",")),
                        repeats=a.repeats)
    print(json.dumps(res, indent=2) if a.json else render_posting(res))
    sys.exit(0 if all(c["verified"] for c in res["cases"]) else 1)
