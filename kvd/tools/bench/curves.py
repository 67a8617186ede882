"""Scale curves: throughput vs request size and vs concurrent pulls, printed and plotted.

Where does kvd leave the ceiling? One run, same machine, same memory kind:

* **size curve**: one pull of 1 block ... ``max_mib`` (random block ids of a pool
  1.25x the largest request), kvd end to end (``publish`` -> ``done_recving`` at the
  client, median) next to raw NIXL READ of the same bytes as one descriptor (the
  ceiling), raw NIXL posting exactly kvd's descriptors when the bench geometry can
  build them, and memcpy;
* **concurrency curve**: N pulls of ``conc_mib`` each (1 ... ``max_concurrency``)
  issued back to back, destination blocks disjoint; aggregate GB/s = N x bytes /
  (first pull call -> last done_recving), next to the single-pull figure.

``plot()`` draws both as a PNG (matplotlib, the optional ``plot`` extra).
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
from kvd.tools.bench.raw import bench_memcpy, bench_nixl, fill_test_pattern

MAX_MIB = 1024
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


def size_points(block_nbytes: int, max_mib: int) -> list[int]:
    """Request sizes in blocks: 1, 4, 16, ... (x4) up to max_mib, the cap included."""
    cap = max(1, max_mib * MiB // block_nbytes)
    points, n = [], 1
    while n < cap:
        points.append(n)
        n *= 4
    points.append(cap)
    return points


def _repeats_for(nbytes: int, repeats: int) -> int:
    """Small pulls are latency-bound and noisy: more samples, same wall time roughly."""
    return max(repeats, min(50, int(64 * MiB // max(nbytes, 1))))


def _raw(geom: Geometry, sizes: list[int], pool_blocks: int, ids: dict[int, tuple],
         repeats: int, shm_dir: str) -> dict[int, dict[str, float]]:
    """Raw NIXL per size on shm pools like kvd's: one descriptor, and kvd's descriptors.

    Small sizes (latency-bound) get more samples than big ones: two process pairs."""
    try:
        from kvd.tools.bench.geometry import HOMOGENEOUS, kvd_descriptors
    except ImportError:  # geometry.py being rewritten
        kvd_descriptors = None
    total = pool_blocks * geom.block_nbytes
    out: dict[int, dict[str, float]] = {}
    small = [n for n in sizes if n * geom.block_nbytes <= 64 * MiB]
    for group in (small, [n for n in sizes if n not in small]):
        if not group:
            continue
        sets = []
        for n in group:
            nbytes = n * geom.block_nbytes
            sets.append((f"one:{n}", "shm", np.array([0]), np.array([0]), np.array([nbytes])))
            if kvd_descriptors is not None:
                p_ids, d_ids = ids[n]
                lo, ro, nb, _, _ = kvd_descriptors(geom, HOMOGENEOUS, pool_blocks, pool_blocks,
                                                   p_ids, d_ids)
                sets.append((f"kvd:{n}", "shm", lo, ro, nb))
        res = bench_nixl(total, total, sets,
                         _repeats_for(group[0] * geom.block_nbytes, repeats),
                         check_set=f"one:{group[-1]}", shm_dir=shm_dir, kinds=("shm",),
                         timeout_s=900.0)
        if not res.get("verified"):
            raise RuntimeError("raw NIXL READ did not deliver the expected bytes")
        for name, _, _, _, nb in sets:
            kind, n = name.split(":")
            nbytes = int(n) * geom.block_nbytes
            row = out.setdefault(int(n), {})
            gbps = fmt_gbps(nbytes, statistics.median(res[name]))
            if kind == "one":
                row["nixl_gbps"] = gbps
            else:
                row["nixl_kvd_descriptors_gbps"] = gbps
                row["descriptors"] = len(nb)
    return out


def run_curves(max_mib: int = MAX_MIB, repeats: int = 5, conc_mib: int = 32,
               concurrency: tuple[int, ...] = CONCURRENCY, kv_layout: str = DEFAULT_KV_LAYOUT,
               shm_dir: str = DEFAULT_SHM_DIR, seed: int = 7,
               daemon_args: tuple[str, ...] = ()) -> dict[str, Any]:
    from kvd.tools.bench.e2e import check_pulled_blocks, timed_pull
    from kvd.tools.localcluster import DaemonProcess
    from kvd.tools.sim import layout_spec

    started = time.perf_counter()
    geom = Geometry(kv_layout=kv_layout)
    sizes = size_points(geom.block_nbytes, max_mib)
    pool_blocks = sizes[-1] + max(1, sizes[-1] // 4)
    conc_blocks = max(1, conc_mib * MiB // geom.block_nbytes)
    d_pool_blocks = max(pool_blocks, max(concurrency) * conc_blocks)
    rng = random.Random(seed)
    ids = {n: (rng.sample(range(pool_blocks), n), rng.sample(range(pool_blocks), n))
           for n in sizes}
    memcpy = bench_memcpy(sizes[-1] * geom.block_nbytes, repeats, shm_dir)
    raw = _raw(geom, sizes, pool_blocks, ids, repeats, shm_dir)

    logs = Path(tempfile.mkdtemp(prefix="kvd-curves-"))
    # NIXL READs, as between two nodes (the last --set wins: daemon_args may turn it on)
    extra = ["--set", f"shm_dir={shm_dir}", "--set", "host_pulls=false", *daemon_args]
    prefill = DaemonProcess.start("curves-prefill", logs, extra_args=extra)
    decode = DaemonProcess.start("curves-decode", logs, extra_args=extra)
    pc, dc = prefill.client(timeout_s=60), decode.client(timeout_s=60)
    size_rows: list[dict[str, Any]] = []
    conc_rows: list[dict[str, Any]] = []
    try:
        model = geom.model()
        prank = pc.register("prefill", model, layout_spec(geom.shape(1, pool_blocks)), 0, 1)
        fill_test_pattern(prank.kv.reshape(-1).view(np.uint8))
        drank = dc.register("decode", model, layout_spec(geom.shape(1, d_pool_blocks)), 0, 1)
        addr = prefill.peer_address
        for n in sizes:
            p_ids, d_ids = ids[n]
            timed_pull(pc, dc, addr, "decode", f"s{n}-warm", p_ids, d_ids)
            ok = check_pulled_blocks(prank.kv, [drank.kv], geom, p_ids, d_ids)
            times = [timed_pull(pc, dc, addr, "decode", f"s{n}-{i}", p_ids, d_ids)[0]
                     for i in range(_repeats_for(n * geom.block_nbytes, repeats))]
            nbytes = n * geom.block_nbytes
            row = {"blocks": n, "nbytes": nbytes, "kvd_gbps": fmt_gbps(nbytes,
                                                                    statistics.median(times)),
                   "kvd_p50_ms": round(statistics.median(times) * 1e3, 3),
                   "memcpy_gbps": memcpy["memcpy_gbps_shm"], **raw[n], "verified": ok}
            row["ratio_kvd_nixl"] = round(row["kvd_gbps"] / row["nixl_gbps"], 3)
            size_rows.append(row)
        p_ids = rng.sample(range(pool_blocks), conc_blocks)
        single = None
        for c in concurrency:
            times = []
            for rep in range(max(3, repeats // 2)):
                rids = [f"c{c}-{rep}-{i}" for i in range(c)]
                receipts = [pc.publish("prefill", rid, p_ids) for rid in rids]
                t0 = time.perf_counter()
                for i, rid in enumerate(rids):
                    dc.pull("decode", rid, "prefill", addr, p_ids,
                            list(range(i * conc_blocks, (i + 1) * conc_blocks)),
                            publish_receipt=receipts[i])
                for rid in rids:
                    ev = dc.wait("decode", rid, "done_recving", timeout_s=120)
                    if not ev.ok:
                        raise RuntimeError(f"pull {rid} failed: {ev.error}")
                times.append(time.perf_counter() - t0)
                for rid in rids:
                    pc.wait("prefill", rid, "done_sending", timeout_s=30)
            nbytes = c * conc_blocks * geom.block_nbytes
            gbps = fmt_gbps(nbytes, statistics.median(times))
            single = gbps if c == 1 else single
            conc_rows.append({"concurrency": c, "pull_nbytes": conc_blocks * geom.block_nbytes,
                              "kvd_gbps": gbps,
                              "ratio_vs_single": round(gbps / single, 3) if single else None})
        ok = check_pulled_blocks(prank.kv, [drank.kv], geom, p_ids,
                           list(range((concurrency[-1] - 1) * conc_blocks,
                                      concurrency[-1] * conc_blocks)))
        conc_rows[-1]["verified"] = ok
    finally:
        pc.close()
        dc.close()
        prefill.stop()
        decode.stop()
    import os

    return {"geometry": geom.to_json(), "repeats": repeats, "shm_dir": shm_dir,
            "size_curve": size_rows, "concurrency_curve": conc_rows,
            "memcpy_gbps": memcpy["memcpy_gbps"], "memcpy_gbps_shm": memcpy["memcpy_gbps_shm"],
            # the shm buffers are allocated like the daemons' pools (pool_backing auto)
            "pool_backing": memcpy.get("shm_buffers_backing"),
            "pool_page_nbytes": memcpy.get("shm_buffers_page_nbytes"),
            "loadavg_1m_end": round(os.getloadavg()[0], 2), "logs": str(logs),
            "seconds": round(time.perf_counter() - started, 1)}


def _fmt_bytes(n: int) -> str:
    if n >= 1024 * MiB:
        return f"{n / (1024 * MiB):g} GiB"
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 1024:g} KiB"


def render_curves(result: dict[str, Any]) -> str:
    lines = ["throughput vs request size (GB/s; one pull at a time)", ""]
    head = ["size", "blocks", "kvd", "p50 ms", "nixl 1 desc", "nixl kvd-descs", "memcpy shm",
            "kvd/nixl", "descs", "ok"]
    rows = [head]
    for r in result["size_curve"]:
        rows.append([_fmt_bytes(r["nbytes"]), str(r["blocks"]), str(r["kvd_gbps"]),
                     str(r["kvd_p50_ms"]), str(r["nixl_gbps"]),
                     str(r.get("nixl_kvd_descriptors_gbps", "-")), str(r["memcpy_gbps"]),
                     str(r["ratio_kvd_nixl"]), str(r.get("descriptors", "-")),
                     str(r["verified"])])
    lines += _table(rows)
    lines += ["", "throughput vs concurrent pulls (aggregate GB/s)", ""]
    rows = [["pulls", "each", "kvd", "x single"]]
    for r in result["concurrency_curve"]:
        rows.append([str(r["concurrency"]), _fmt_bytes(r["pull_nbytes"]), str(r["kvd_gbps"]),
                     str(r["ratio_vs_single"])])
    lines += _table(rows)
    g = result["geometry"]
    lines += ["", f"layout {g['kv_layout']}, {g['block_nbytes'] // MiB} MiB blocks, pools "
              f"{_pools(result)}, medians of >= {result['repeats']}; load at end "
              f"{result['loadavg_1m_end']}; {result['seconds']} s"]
    return "\n".join(lines)


def _pools(result: dict[str, Any]) -> str:
    """Where the pools lived and on which pages: the figures depend on it (huge pages or not)."""
    where = f"in {result['shm_dir']}"
    if result.get("pool_backing"):
        where += f" ({result['pool_backing']}, {(result.get('pool_page_nbytes') or 0) // 1024}"\
                 " KiB pages)"
    return where


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Both curves side by side in one PNG. Needs matplotlib: pip install 'kvd[plot]'."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from kvd.errors import KvdError

        raise KvdError("--plot needs matplotlib: pip install 'kvd[plot]' "
                       "(or pip install 'matplotlib>=3.7')") from None
    sizes = result["size_curve"]
    conc = result["concurrency_curve"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    x = [r["nbytes"] / MiB for r in sizes]
    ax1.plot(x, [r["memcpy_gbps"] for r in sizes], ":", color="grey", label="memcpy (shm)")
    ax1.plot(x, [r["nixl_gbps"] for r in sizes], "s--", color="tab:green",
             label="raw NIXL, 1 descriptor")
    if all("nixl_kvd_descriptors_gbps" in r for r in sizes):
        ax1.plot(x, [r["nixl_kvd_descriptors_gbps"] for r in sizes], "^--", color="tab:orange",
                 label="raw NIXL, kvd's descriptors")
    ax1.plot(x, [r["kvd_gbps"] for r in sizes], "o-", color="tab:blue", linewidth=2,
             label="kvd end to end")
    for r in sizes:
        ms = r["kvd_p50_ms"]
        ax1.annotate(f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms",
                     (r["nbytes"] / MiB, r["kvd_gbps"]),
                     textcoords="offset points", xytext=(0, -14), ha="center", fontsize=7,
                     color="tab:blue")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(x, [_fmt_bytes(r["nbytes"]) for r in sizes], rotation=30)
    ax1.set_xlabel("request size (one pull)")
    ax1.set_ylabel("GB/s (kvd: labelled with its p50 latency)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Throughput vs request size")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8, loc="best")
    cx = [r["concurrency"] for r in conc]
    ax2.plot(cx, [r["kvd_gbps"] for r in conc], "o-", color="tab:blue", linewidth=2,
             label=f"kvd, {_fmt_bytes(conc[0]['pull_nbytes'])} pulls (aggregate)")
    ax2.axhline(conc[0]["kvd_gbps"], color="tab:blue", linestyle=":", alpha=0.6,
                label="kvd, one pull")
    ax2.axhline(0.8 * conc[0]["kvd_gbps"], color="tab:red", linestyle=":", alpha=0.5,
                label="0.8 x one pull (target)")
    top = sizes[-1]
    ax2.axhline(top["nixl_gbps"], color="tab:green", linestyle="--", alpha=0.6,
                label=f"raw NIXL, 1 descriptor of {_fmt_bytes(top['nbytes'])}")
    ax2.axhline(top["memcpy_gbps"], color="grey", linestyle=":", label="memcpy (shm)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(cx, [str(c) for c in cx])
    ax2.set_xlabel("concurrent pulls")
    ax2.set_ylabel("GB/s")
    ax2.set_ylim(0, 1.3 * max(top["memcpy_gbps"], top["nixl_gbps"],
                               max(r["kvd_gbps"] for r in conc)))
    ax2.set_title("Throughput vs concurrency")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8, loc="best", framealpha=0.9)
    g = result["geometry"]
    fig.suptitle(f"kvd scale curves: layout {g['kv_layout']}, "
                 f"{g['block_nbytes'] // MiB} MiB blocks, random block ids, pools "
                 f"{_pools(result)}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(as_json: bool = False, max_mib: int = MAX_MIB, repeats: int = 5, conc_mib: int = 32,
         concurrency: tuple[int, ...] = CONCURRENCY, kv_layout: str = DEFAULT_KV_LAYOUT,
         shm_dir: str = DEFAULT_SHM_DIR, plot_path: str | None = None) -> int:
    import json

    if plot_path:  # fail before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from kvd.errors import KvdError

            raise KvdError("--plot needs matplotlib: pip install 'kvd[plot]' "
                           "(or pip install 'matplotlib>=3.7')") from None
    result = run_curves(max_mib=max_mib, repeats=repeats, conc_mib=conc_mib,
                        concurrency=concurrency, kv_layout=kv_layout, shm_dir=shm_dir)
    if plot_path:
        result["plot"] = str(plot(result, plot_path))
    print(json.dumps(result, indent=2) if as_json else render_curves(result))
    ok = all(r["verified"] for r in result["size_curve"]) and result["concurrency_curve"][-1][
        "verified"]
    return 0 if ok else 1
