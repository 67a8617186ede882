"""Where a progressive run's time went: per run of ``progressive_tail.py --breakdown``
(its ``bench-N.json``, with the traces of ``work-N/trace`` next to it).

Prints each system's TTFT per round, the issue's tail (``ttft_minus_plain_p50_ms``), the
tail against the plain engine's best round of the run (a steadier reference on a noisy
host: the ratio errs towards 1), and per progressive pull, from the traces: the decode's
pull sent to the prefill's first and last (complete) seal (the prefill's compute, as the
decode sees it), and the complete seal to the decode worker reporting the KV to vLLM
(kvd's part after the prefill ended).

    .venv/bin/python benchmarks/progressive_traces.py /tmp/prog3/after/bench-8192.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from kvd.ops.trace import read_traces

PAIRS = (("kvd-1d", "kvd-1d-prog"), ("kvd-2d-nixl", "kvd-2d-nixl-prog"))


def ttfts_ms(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for s in result["singles"]:
        if s["ttft_s"] is not None:
            out.setdefault(s["system"], {})[s["round"]] = round(s["ttft_s"] * 1000, 1)
    return out


def tails_vs_best_plain_ms(ttfts: dict[str, dict[int, float]]) -> dict[str, float]:
    """Median of a system's warm rounds (round 0 is the warm-up) minus the plain
    engine's best TTFT of the run."""
    best = min(ttfts["plain"].values())
    return {name: round(statistics.median(v for r, v in by.items() if r > 0) - best, 1)
            for name, by in ttfts.items()
            if name != "plain" and any(r > 0 for r in by)}


def progressive_pulls_ms(trace_dir: Path) -> list[tuple[float, float, float, int]]:
    """Per progressive pull: (pull -> first seal, pull -> complete seal, complete seal
    -> reported to vLLM, seals); a pull no seal followed was sequential."""
    points = read_traces(str(trace_dir))
    seals = [ns for ns, point, _, _ in points if point == "seal_sent"]
    reported = {rid: ns for ns, point, rid, _ in points if point == "recv_reported"}
    rows = []
    for ns, point, rid, _ in points:
        end = reported.get(rid)
        if point != "pull_sent" or end is None:
            continue
        mine = [s for s in seals if ns - 50e6 <= s <= end]  # the router sends both at once
        if mine:
            rows.append(((mine[0] - ns) / 1e6, (mine[-1] - ns) / 1e6,
                         (end - mine[-1]) / 1e6, len(mine)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", nargs="+", help="bench-N.json of a --breakdown run")
    args = ap.parse_args()
    for path in map(Path, args.bench_json):
        result = json.loads(path.read_text())
        ttfts = ttfts_ms(result)
        print(f"== {path} (host {result.get('host')})")
        print("TTFT ms per round:", json.dumps({n: list(v.values()) for n, v in ttfts.items()}))
        print("tail ms (issue's):", {s["system"]: s.get("ttft_minus_plain_p50_ms")
                                     for s in result["summaries"] if s["system"] != "plain"})
        best = tails_vs_best_plain_ms(ttfts)
        ratios = {prog: round(best[prog] / best[seq], 2) for seq, prog in PAIRS
                  if best.get(seq, 0) > 0 and prog in best}
        print("tail ms vs the plain engine's best round:", best, "ratios:", ratios)
        trace_dir = path.parent / path.name.replace("bench-", "work-").replace(".json", "") \
            / "trace"
        if trace_dir.is_dir():
            print("progressive pulls: pull->first seal, pull->complete seal, "
                  "complete seal->reported (ms), seals")
            for row in progressive_pulls_ms(trace_dir):
                print(f"  {row[0]:8.1f} {row[1]:8.1f} {row[2]:8.1f} {row[3]:4d}")


if __name__ == "__main__":
    main()
