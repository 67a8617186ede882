"""Where splitting a READ over posting workers starts to pay: ``kvd bench split``.

Two spawned processes: the target owns a pool (shm, allocated like kvd's) and makes
NIXL progress; the initiator owns a `WorkerSet` of ``workers`` NIXL agents (what a
daemon with ``posting_workers = N`` has) over a pool of the same kind and READs one
contiguous descriptor of each size (the pull that the planner merged into one),
whole on worker 0 (as every READ below twice the threshold is) or cut by bytes into
2 .. ``workers`` parts (``kvd.transport.remote.split``), each part on its worker's thread;
a fresh descriptor list each, as the daemon posts a READ of a few descriptors.
Per size the variants take turns read by read (the same background load falls on
each), each at a new offset of the pool (no read comes from a cache), timed from the
post to DONE; medians. The part size where the split first wins is the threshold
(``kvd.transport.remote.workers.MIN_PART_NBYTES``); the destination is checked byte for byte.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from kvd.tools.bench.geometry import DEFAULT_SHM_DIR
from kvd.tools.bench.raw import end_children

MiB = 1 << 20
SIZES_KIB = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
TARGET_POLL_S = 0.0002  # the target's progress loop (kvd's producer polls every ~1 ms)


def _target(conn: Any, stop: Any, nbytes: int, shm_dir: str) -> None:
    from kvd.tools.bench.raw import alloc_buffer, fill_test_pattern
    from kvd.transport.remote.nixl import NixlTransport

    t = NixlTransport(name=f"split-target-{os.getpid()}")
    buf, pool = alloc_buffer("shm", nbytes, shm_dir)
    fill_test_pattern(buf)
    t.register(int(buf.ctypes.data), nbytes, "DRAM", 0)
    conn.send((t.metadata(), int(buf.ctypes.data)))
    while not stop.is_set():
        t.notifications()
        time.sleep(TARGET_POLL_S)
    t.close()
    del buf
    if pool is not None:
        pool.close()


def _initiator(conn: Any, meta: bytes, remote_base: int, pool_nbytes: int, sizes: list[int],
               parts: list[int], workers: int, repeats: int, shm_dir: str) -> None:
    from kvd.tools.bench.raw import alloc_buffer
    from kvd.transport.base import ReadPost
    from kvd.transport.remote.nixl import NixlTransport
    from kvd.transport.remote.workers import WorkerSet

    ws = WorkerSet([NixlTransport(name=f"split-init-{os.getpid()}-{i}")
                    for i in range(workers)], min_part_nbytes=1)
    buf, pool = alloc_buffer("shm", pool_nbytes, shm_dir)
    buf.fill(0)
    base = int(buf.ctypes.data)
    ws.register(base, pool_nbytes, "DRAM", 0)
    peer = ws.add_peer(meta)
    rows: list[dict[str, Any]] = []
    verified = True
    for size in sizes:
        slots = max(1, pool_nbytes // size)
        times: dict[int, list[float]] = {k: [] for k in parts}
        posted: dict[int, list[float]] = {k: [] for k in parts}  # post_read's return
        at_post: dict[int, int] = dict.fromkeys(parts, 0)  # READs done when posted
        for rep in range(2 + repeats):  # 2 warm-up rounds (connections, page pinning)
            order = parts if rep % 2 == 0 else parts[::-1]
            for i, k in enumerate(order):
                off = ((rep * len(parts) + i) % slots) * size
                post = ReadPost(peer=peer, local_addrs=np.array([base + off]),
                                remote_addrs=np.array([remote_base + off]),
                                nbytes=np.array([size]), mem_type="DRAM", notif=b"")
                ws.posting = list(range(k))  # k parts: workers 0 .. k-1
                t0 = time.perf_counter()
                xfer, done = ws.post_read(post)
                t_posted = time.perf_counter()
                if rep >= 2:
                    posted[k].append(t_posted - t0)
                    at_post[k] += bool(done)
                while not done:
                    done = ws.poll(xfer)
                elapsed = time.perf_counter() - t0
                ws.release(xfer)
                if rep >= 2:
                    times[k].append(elapsed)
                words = buf[off:off + size].view(np.uint64)
                want = np.arange(off // 8, (off + size) // 8, dtype=np.uint64)
                verified = verified and bool(np.array_equal(words, want))
                buf[off:off + size] = 0
        whole = statistics.median(times[parts[0]])
        for k in parts:
            med = statistics.median(times[k])
            rows.append({"nbytes": size, "parts": k, "part_nbytes": size // k,
                         "p50_us": round(med * 1e6, 1),
                         "p90_us": round(float(np.percentile(times[k], 90)) * 1e6, 1),
                         "posted_p50_us": round(statistics.median(posted[k]) * 1e6, 1),
                         "done_at_post": round(at_post[k] / len(times[k]), 2),
                         "gbps": round(size / med / 1e9, 2),
                         "speedup_vs_whole": round(whole / med, 3)})
    ws.close()
    del buf
    if pool is not None:
        pool.close()
    conn.send({"rows": rows, "verified": verified})


def bench_split(sizes_kib: tuple[int, ...] = SIZES_KIB, workers: int = 2, repeats: int = 30,
                shm_dir: str = DEFAULT_SHM_DIR, timeout_s: float = 600.0) -> dict[str, Any]:
    sizes = [s * 1024 for s in sizes_kib]
    parts = [1, *range(2, workers + 1)]
    pool_nbytes = max(256 * MiB, 4 * max(sizes))
    started = time.perf_counter()
    load0 = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    stop = ctx.Event()
    target = ctx.Process(target=_target, args=(t_child, stop, pool_nbytes, shm_dir),
                         daemon=True)
    target.start()
    initiator = None
    try:
        if not t_parent.poll(timeout_s):
            raise RuntimeError("NIXL target did not start")
        meta, remote_base = t_parent.recv()
        initiator = ctx.Process(target=_initiator, daemon=True,
                                args=(i_child, meta, remote_base, pool_nbytes, sizes, parts,
                                      workers, repeats, shm_dir))
        initiator.start()
        if not i_parent.poll(timeout_s):
            raise RuntimeError("NIXL initiator did not report")
        res = i_parent.recv()
    finally:
        end_children(stop, initiator, target)
    return {"workers": workers, "repeats": repeats, "shm_dir": shm_dir, "rows": res["rows"],
            "threshold_part_nbytes": threshold(res["rows"]), "verified": res["verified"],
            "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "seconds": round(time.perf_counter() - started, 1)}


def threshold(rows: list[dict[str, Any]], gain: float = 1.1) -> int | None:
    """The smallest part size from which every larger size's 2-part split is at least
    ``gain`` x faster than the whole READ (None: it never is)."""
    two = sorted((r for r in rows if r["parts"] == 2), key=lambda r: r["nbytes"])
    best = None
    for r in reversed(two):
        if r["speedup_vs_whole"] < gain:
            break
        best = r["part_nbytes"]
    return best


def render_split(result: dict[str, Any]) -> str:
    head = ["READ", "parts", "part", "p50 us", "p90 us", "posted us", "done at post", "GB/s",
            "x whole"]
    table = [head]
    for r in result["rows"]:
        table.append([_fmt(r["nbytes"]), str(r["parts"]), _fmt(r["part_nbytes"]),
                      str(r["p50_us"]), str(r["p90_us"]), str(r.get("posted_p50_us", "-")),
                      str(r.get("done_at_post", "-")), str(r["gbps"]),
                      str(r["speedup_vs_whole"])])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    th = result["threshold_part_nbytes"]
    lines += ["", f"one contiguous descriptor per READ, whole on one agent or cut by bytes over "
              f"{result['workers']} posting workers; medians of {result['repeats']}, the "
              f"variants taking turns; load {result['loadavg_1m']}; {result['seconds']} s",
              f"split wins (>= 1.1x) from parts of {_fmt(th) if th else 'no size measured'}; "
              f"verified {result['verified']}",
              "posted: post_read's return (cma copies inside transfer(), so mostly the READ "
              "itself); done at post: share of READs already DONE then"]
    return "\n".join(lines)


def _fmt(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 1024:g} KiB"
