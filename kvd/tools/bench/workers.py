"""Workers x size curve: one pull of 32 MiB ... 1 GiB through daemons with 1, 2
and 4 posting workers, next to the best single-stream raw NIXL READ of the same bytes.

One run, same machine, same memory kind (pools like kvd's, in ``shm_dir``): raw NIXL
first (one descriptor per size, one posting thread: the single-stream ceiling), then
for each worker count a daemon pair (``--set posting_workers=N``), ``publish`` ->
``done_recving`` at the client (median), checked byte for byte at every size, for two
block-id patterns: random ids of a pool 1.25x the largest request (a fragmented
cache) and consecutive ids on both sides (``contiguous``: a fresh engine's cache, one
descriptor once merged, which the READ split cuts by bytes). All pairs run at once and take turns
pull by pull, so that load from elsewhere on a shared host falls on every worker count
alike (``ratio_vs_one_worker``, within one pattern). ``plot_workers`` draws GB/s
against size, one line per worker count and pattern, and the raw single stream.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.bench.geometry import DEFAULT_KV_LAYOUT, DEFAULT_SHM_DIR, Geometry, MiB, fmt_gbps
from kvd.tools.bench.raw import bench_nixl, fill_test_pattern

WORKERS = (1, 2, 4)
SIZES_MIB = (32, 64, 128, 256, 512, 1024)
PATTERNS = ("random", "contiguous")


def _zero(kv: np.ndarray, geom: Geometry, block_ids: list[int]) -> None:
    """Destination blocks zeroed before a checked pull: the check then proves that pull."""
    from kvd.tools.sim import blocks_view

    view = blocks_view(kv, geom.kv_layout, geom.head_layout)
    for b in block_ids:
        view[b] = 0


def _raw_single_stream(sizes: list[int], block_nbytes: int, repeats: int, shm_dir: str
                       ) -> dict[int, float]:
    total = max(sizes) * block_nbytes
    sets = [(f"one:{n}", "shm", np.array([0]), np.array([0]), np.array([n * block_nbytes]))
            for n in sizes]
    res = bench_nixl(total, total, sets, repeats, check_set=f"one:{sizes[-1]}",
                     shm_dir=shm_dir, kinds=("shm",), timeout_s=900.0)
    if not res.get("verified"):
        raise RuntimeError("raw NIXL READ did not deliver the expected bytes")
    return {n: fmt_gbps(n * block_nbytes, statistics.median(res[f"one:{n}"])) for n in sizes}


def run_workers_curve(workers: tuple[int, ...] = WORKERS,
                      sizes_mib: tuple[int, ...] = SIZES_MIB, repeats: int = 5,
                      kv_layout: str = DEFAULT_KV_LAYOUT, shm_dir: str = DEFAULT_SHM_DIR,
                      seed: int = 7, patterns: tuple[str, ...] = PATTERNS) -> dict[str, Any]:
    from kvd.tools.bench.e2e import check_pulled_blocks, timed_pull
    from kvd.tools.localcluster import DaemonProcess
    from kvd.tools.sim import layout_spec

    started = time.perf_counter()
    geom = Geometry(kv_layout=kv_layout)
    sizes = sorted({max(1, m * MiB // geom.block_nbytes) for m in sizes_mib})
    pool_blocks = sizes[-1] + max(1, sizes[-1] // 4)
    rng = random.Random(seed)
    ids = {("random", n): (rng.sample(range(pool_blocks), n), rng.sample(range(pool_blocks), n))
           for n in sizes}
    ids.update({("contiguous", n): (list(range(n)), list(range(n))) for n in sizes})
    raw = _raw_single_stream(sizes, geom.block_nbytes, repeats, shm_dir)
    logs = Path(tempfile.mkdtemp(prefix="kvd-workers-"))
    rows: list[dict[str, Any]] = []
    model = geom.model()
    pairs: dict[int, tuple[Any, ...]] = {}
    try:
        for w in workers:  # every pair up at once: their pulls interleave (see below)
            extra = ["--set", f"shm_dir={shm_dir}", "--set", f"posting_workers={w}",
                     "--set", "host_pulls=false"]  # NIXL READs, as between two nodes
            prefill = DaemonProcess.start(f"workers{w}-prefill", logs, extra_args=extra)
            pairs[w] = (prefill,)
            decode = DaemonProcess.start(f"workers{w}-decode", logs, extra_args=extra)
            pc, dc = prefill.client(timeout_s=120), decode.client(timeout_s=120)
            pairs[w] = (prefill, decode, pc, dc)
            prank = pc.register("prefill", model, layout_spec(geom.shape(1, pool_blocks)), 0, 1)
            fill_test_pattern(prank.kv.reshape(-1).view(np.uint8))
            drank = dc.register("decode", model, layout_spec(geom.shape(1, pool_blocks)), 0, 1)
            pairs[w] = (prefill, decode, pc, dc, prank, drank)
        for n, pattern in ((n, p) for n in sizes for p in patterns):
            p_ids, d_ids = ids[(pattern, n)]
            tag = f"{pattern[0]}{n}"
            times: dict[int, list[float]] = {w: [] for w in workers}
            ok: dict[int, bool] = {}
            for w in workers:
                _, _, pc, dc, prank, drank = pairs[w]
                _zero(drank.kv, geom, d_ids)
                timed_pull(pc, dc, pairs[w][0].peer_address, "decode", f"w{w}-{tag}-warm",
                           p_ids, d_ids)
                ok[w] = check_pulled_blocks(prank.kv, [drank.kv], geom, p_ids, d_ids)
            # Worker counts take turns, pull by pull: on a shared host, load that comes and
            # goes lands on every count alike instead of on whichever ran then.
            for i in range(repeats):
                for w in workers:
                    prefill, _, pc, dc, _, _ = pairs[w]
                    times[w].append(timed_pull(pc, dc, prefill.peer_address, "decode",
                                               f"w{w}-{tag}-{i}", p_ids, d_ids)[0])
            nbytes = n * geom.block_nbytes
            for w in workers:
                gbps = fmt_gbps(nbytes, statistics.median(times[w]))
                rows.append({"workers": w, "ids": pattern, "nbytes": nbytes, "kvd_gbps": gbps,
                             "kvd_p50_ms": round(statistics.median(times[w]) * 1e3, 2),
                             "nixl_single_stream_gbps": raw[n],
                             "ratio_vs_single_stream": round(gbps / raw[n], 3),
                             "ratio_vs_one_worker": round(
                                 gbps / fmt_gbps(nbytes, statistics.median(times[workers[0]])),
                                 3),
                             "verified": ok[w]})
        extra_rows = _latency_and_concurrency(pairs, workers, geom, pool_blocks, repeats)
    finally:
        for pair in pairs.values():
            for client in pair[2:4]:
                client.close()
            for daemon in pair[:2]:
                daemon.stop()
    import os

    return {"geometry": geom.to_json(), "repeats": repeats, "shm_dir": shm_dir,
            "workers_curve": rows, "workers_small_and_concurrent": extra_rows,
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
            "logs": str(logs), "seconds": round(time.perf_counter() - started, 1)}


def _latency_and_concurrency(pairs: dict[int, tuple[Any, ...]], workers: tuple[int, ...],
                             geom: Geometry, pool_blocks: int, repeats: int,
                             latency_pulls: int = 200, concurrent: int = 16
                             ) -> list[dict[str, Any]]:
    """Per worker count, taking turns like the curve: 1-block pull latency (pull call
    to its answer; small READs stay on the daemon's agent, so this shows what the
    workers cost them) and ``concurrent`` 32 MiB pulls at once against one."""
    from kvd.tools.bench.e2e import check_pulled_blocks, timed_pull

    per = max(1, 32 * MiB // geom.block_nbytes)
    concurrent = max(1, min(concurrent, pool_blocks // per))
    src = random.Random(3).sample(range(pool_blocks), per)
    dst = [list(range(i * per, (i + 1) * per)) for i in range(concurrent)]
    lat: dict[int, list[float]] = {w: [] for w in workers}
    single: dict[int, list[float]] = {w: [] for w in workers}
    conc: dict[int, list[float]] = {w: [] for w in workers}
    for i in range(latency_pulls + 20):
        for w in workers:
            prefill, _, pc, dc, _, _ = pairs[w]
            t = timed_pull(pc, dc, prefill.peer_address, "decode", f"w{w}-lat{i}",
                           [i % pool_blocks], [(i * 7) % pool_blocks])[1]
            if i >= 20:  # warm-up
                lat[w].append(t)
    for rep in range(max(3, repeats)):
        for w in workers:
            prefill, _, pc, dc, _, _ = pairs[w]
            addr = prefill.peer_address
            single[w].append(timed_pull(pc, dc, addr, "decode", f"w{w}-one{rep}", src,
                                        dst[0])[1])
            rids = [f"w{w}-conc{rep}-{i}" for i in range(concurrent)]
            receipts = [pc.publish("prefill", rid, src) for rid in rids]
            t0 = time.perf_counter()
            for rid, d, receipt in zip(rids, dst, receipts, strict=True):
                dc.pull("decode", rid, "prefill", addr, src, d, publish_receipt=receipt)
            for rid in rids:
                ev = dc.wait("decode", rid, "done_recving", timeout_s=120)
                if not ev.ok:
                    raise RuntimeError(f"pull {rid} failed: {ev.error}")
            conc[w].append(time.perf_counter() - t0)
            for rid in rids:
                pc.wait("prefill", rid, "done_sending", timeout_s=30)
    out = []
    nbytes = per * geom.block_nbytes
    for w in workers:
        _, _, _, _, prank, drank = pairs[w]
        q = statistics.quantiles(lat[w], n=100)
        one = fmt_gbps(nbytes, statistics.median(single[w]))
        many = fmt_gbps(concurrent * nbytes, statistics.median(conc[w]))
        out.append({"workers": w, "pull_1block_p50_ms": round(statistics.median(lat[w]) * 1e3, 3),
                    "pull_1block_p99_ms": round(q[98] * 1e3, 3),
                    "single_pull_gbps": one, "concurrent_pulls": concurrent,
                    "concurrent_gbps": many, "ratio_concurrent_vs_single": round(many / one, 3),
                    "verified": all(check_pulled_blocks(prank.kv, [drank.kv], geom, src, d)
                                    for d in dst)})
    return out


def _fmt(n: int) -> str:
    return f"{n / (1024 * MiB):g} GiB" if n >= 1024 * MiB else f"{n / MiB:g} MiB"


def _pattern_rows(result: dict[str, Any], pattern: str) -> list[dict[str, Any]]:
    return [r for r in result["workers_curve"] if r.get("ids", "random") == pattern]


def render_workers(result: dict[str, Any]) -> str:
    lines: list[str] = []
    for pattern in PATTERNS:
        rows = _pattern_rows(result, pattern)
        if not rows:
            continue
        workers = sorted({r["workers"] for r in rows})
        sizes = sorted({r["nbytes"] for r in rows})
        by = {(r["workers"], r["nbytes"]): r for r in rows}
        head = ["size", "nixl 1 stream", *(f"{w} workers" for w in workers),
                *(f"x stream ({w}w)" for w in workers),
                *(f"x 1w ({w}w)" for w in workers[1:]), "ok"]
        table = [head]
        for s in sizes:
            table.append([_fmt(s), str(by[(workers[0], s)]["nixl_single_stream_gbps"]),
                          *(str(by[(w, s)]["kvd_gbps"]) for w in workers),
                          *(str(by[(w, s)]["ratio_vs_single_stream"]) for w in workers),
                          *(str(by[(w, s)]["ratio_vs_one_worker"]) for w in workers[1:]),
                          str(all(by[(w, s)]["verified"] for w in workers))])
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        what = ("random block ids" if pattern == "random"
                else "consecutive block ids (contiguous: one descriptor, split by bytes)")
        lines += [*([""] if lines else []),
                  f"kvd pull throughput (GB/s) by posting workers and size; one pull at a "
                  f"time, {what}", ""]
        body = ["  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in table]
        body.insert(1, "  ".join("-" * wd for wd in widths))
        lines += body
    extra = result.get("workers_small_and_concurrent") or []
    if extra:
        table = [["workers", "1-block p50 ms", "p99 ms", "one 32 MiB pull", "concurrent",
                  "x one", "ok"]]
        table += [[str(r["workers"]), str(r["pull_1block_p50_ms"]), str(r["pull_1block_p99_ms"]),
                   str(r["single_pull_gbps"]),
                   f"{r['concurrent_gbps']} ({r['concurrent_pulls']} pulls)",
                   str(r["ratio_concurrent_vs_single"]), str(r["verified"])] for r in extra]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines += ["", "small pulls and concurrent 32 MiB pulls (GB/s), the counts taking turns",
                  ""]
        lines += ["  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True))
                  for r in table]
    lines += ["", "x stream: kvd / the best single-stream raw NIXL READ (one descriptor, one "
              "thread) of the same bytes on the same memory; x 1w: kvd / kvd with one worker "
              f"(the counts take turns, pull by pull); medians of {result['repeats']}; "
              f"load at end {result['loadavg_1m_end']}; {result['seconds']} s"]
    return "\n".join(lines)


def plot_workers(result: dict[str, Any], path: str | Path) -> Path:
    """GB/s vs size, one line per worker count; needs matplotlib ('kvd[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from kvd.errors import KvdError

        raise KvdError("--plot needs matplotlib: pip install 'kvd[plot]' "
                       "(or pip install 'matplotlib>=3.7')") from None
    rows = result["workers_curve"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    sizes = sorted({r["nbytes"] for r in rows})
    x = [s / MiB for s in sizes]
    first = sorted((r for r in _pattern_rows(result, "random") or rows
                    if r["workers"] == rows[0]["workers"]), key=lambda r: r["nbytes"])
    ax.plot(x, [r["nixl_single_stream_gbps"] for r in first], "s:", color="tab:green",
            label="raw NIXL, one stream")
    colors = ["tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:brown"]
    for i, w in enumerate(sorted({r["workers"] for r in rows})):
        for pattern, style in (("random", "o-"), ("contiguous", "^--")):
            mine = sorted((r for r in _pattern_rows(result, pattern) if r["workers"] == w),
                          key=lambda r: r["nbytes"])
            if mine:
                ax.plot([r["nbytes"] / MiB for r in mine], [r["kvd_gbps"] for r in mine],
                        style, linewidth=2, color=colors[i % len(colors)],
                        label=f"kvd, {w} workers, {pattern} ids")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [_fmt(s) for s in sizes], rotation=30)
    ax.set_xlabel("request size (one pull; solid: random block ids, dashed: consecutive)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title("kvd throughput by posting workers")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(as_json: bool = False, sizes_mib: tuple[int, ...] = SIZES_MIB, repeats: int = 5,
         kv_layout: str = DEFAULT_KV_LAYOUT, shm_dir: str = DEFAULT_SHM_DIR,
         plot_path: str | None = None, workers: tuple[int, ...] = WORKERS) -> int:
    import json

    if plot_path:  # fail before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from kvd.errors import KvdError

            raise KvdError("--plot needs matplotlib: pip install 'kvd[plot]' "
                           "(or pip install 'matplotlib>=3.7')") from None
    result = run_workers_curve(workers=workers, sizes_mib=sizes_mib, repeats=repeats,
                               kv_layout=kv_layout, shm_dir=shm_dir)
    if plot_path:
        result["plot"] = str(plot_workers(result, plot_path))
    print(json.dumps(result, indent=2) if as_json else render_workers(result))
    return 0 if all(r["verified"] for r in result["workers_curve"]
                    + result["workers_small_and_concurrent"]) else 1
