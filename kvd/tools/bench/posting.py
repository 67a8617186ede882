"""Posting cost: prepared descriptor lists vs a fresh list per READ, through kvd's Transport.

Two spawned processes, each with a `NixlTransport` (progress thread off): the target
owns a source pool and polls notifications; the initiator READs a request of
``nbytes`` made of ``chunk``-byte pieces at random chunk ids (a fragmented cache)
into a destination pool, both pools ``pool_factor`` x the request, and times:

* ``fresh``: what the daemon does today (``post_read``): addresses from the ids,
  an (N, 3) array per side, ``get_xfer_descs`` + ``initialize_xfer``, ``transfer``;
* ``prepped``: both pools prepared once as a grid of chunks (one strided row each),
  then per READ the int32 index arrays and ``make_prepped_xfer``, ``transfer``;
* ``poster``: the daemon's wiring (``kvd.transport.remote.prepped.PreppedPoster``): the same
  ReadPost as ``fresh``, turned into indices of pool grids (chunk = gcd of the READ);
* ``*_consecutive``: consecutive ids on both sides (prepared lists merge them into one
  descriptor; fresh lists never merge).

Per case: build time (descriptors + NIXL request: the "posting" cost, also per
descriptor), ``transfer()`` time (UCX cma copies inline), total to DONE, GB/s, and
the posting share of the READ. memcpy of the same bytes in the same run gives the
ceiling, so figures compare as ratios on this noisy shared box.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from kvd.tools.bench.raw import end_children

MiB = 1 << 20
KiB = 1 << 10
# The target polls NIXL (progress, notifications) every TARGET_POLL_S seconds, sleeping in
# between: a READ completes only once the target has progressed it, even without a
# notification (measured: a 512 MiB READ to a target that never polls never finishes),
# and a target spinning flat out competes with the copy on 2 cores. 0: spin.
TARGET_POLL_S = float(os.environ.get("KVD_BENCH_TARGET_POLL_S", "0.0002"))


def _pool(nbytes: int) -> np.ndarray:
    """Heap memory, pre-faulted (the posting cost does not depend on the page size)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


def _target(conn: Any, stop: Any, nbytes: int) -> None:
    from kvd.tools.bench.raw import fill_test_pattern
    from kvd.transport.remote.nixl import NixlTransport

    t = NixlTransport(name=f"post-target-{os.getpid()}")
    buf = _pool(nbytes)
    fill_test_pattern(buf)
    t.register(int(buf.ctypes.data), nbytes, "DRAM", 0)
    conn.send((t.metadata(), int(buf.ctypes.data)))
    while not stop.is_set():  # progress + notifications, sleeping in between (see top)
        t.notifications()
        if TARGET_POLL_S:
            time.sleep(TARGET_POLL_S)
    t.close()


def _verify(buf: np.ndarray, li: np.ndarray, ri: np.ndarray, chunk: int) -> bool:
    """Local chunk li[k] holds remote chunk ri[k] of the target's pattern (words = offset/8)."""
    words = chunk // 8
    got = buf.view(np.uint64).reshape(-1, words)
    step = max(1, (32 * MiB) // chunk)
    for i in range(0, len(li), step):
        want = ri[i:i + step, None].astype(np.uint64) * words + np.arange(words, dtype=np.uint64)
        if not np.array_equal(got[li[i:i + step]], want):
            return False
    return True


def _wait(t: Any, xfer_id: int, done: bool) -> None:
    while not done:
        done = t.poll(xfer_id)


def _initiator(conn: Any, meta: bytes, remote_base: int, pool_nbytes: int, nbytes: int,
               chunks: list[int], repeats: int, seed: int) -> None:
    from kvd.transport.base import DescRows, PreppedRead, ReadPost, merged_count
    from kvd.transport.remote.nixl import NixlTransport
    from kvd.transport.remote.prepped import PoolSpan, PreppedPoster

    t = NixlTransport(name=f"post-init-{os.getpid()}")
    buf = _pool(pool_nbytes)
    base = int(buf.ctypes.data)
    t.register(base, pool_nbytes, "DRAM", 0)
    peer = t.add_peer(meta)
    poster = PreppedPoster(t)
    local_pools, remote_pools = (PoolSpan(base, pool_nbytes),), (PoolSpan(remote_base,
                                                                           pool_nbytes),)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"cases": []}
    for chunk in chunks:
        n = nbytes // chunk
        slots = pool_nbytes // chunk
        p0 = time.perf_counter()
        local_list = t.prepare_local(DescRows.grid(base, chunk, slots))
        remote_list = t.prepare_remote(peer, DescRows.grid(remote_base, chunk, slots))
        prepare_s = time.perf_counter() - p0
        rand_l, rand_r = rng.choice(slots, n, replace=False), rng.choice(slots, n, replace=False)
        consec = np.arange(n)

        def read_post(li: np.ndarray, ri: np.ndarray, chunk: int = chunk) -> ReadPost:
            sizes = np.full(len(li), chunk, dtype=np.int64)
            return ReadPost(peer=peer, local_addrs=base + li * chunk,
                            remote_addrs=remote_base + ri * chunk, nbytes=sizes,
                            mem_type="DRAM", notif=b"bench", local_pools=local_pools,
                            remote_pools=remote_pools)

        def fresh(li: np.ndarray, ri: np.ndarray) -> tuple[int, bool]:
            return t.post_read(read_post(li, ri))

        def via_poster(li: np.ndarray, ri: np.ndarray) -> tuple[int, bool]:
            return poster.post(read_post(li, ri))

        def prepped(li: np.ndarray, ri: np.ndarray, ll: int = local_list,
                    rl: int = remote_list) -> tuple[int, bool]:
            return t.post_prepped_read(PreppedRead(peer, ll, rl, li.astype(np.int32),
                                                   ri.astype(np.int32), b"bench"))

        for method, post, (li, ri) in (("fresh", fresh, (rand_l, rand_r)),
                                       ("prepped", prepped, (rand_l, rand_r)),
                                       ("poster", via_poster, (rand_l, rand_r)),
                                       ("fresh_consecutive", fresh, (consec, consec)),
                                       ("prepped_consecutive", prepped, (consec, consec)),
                                       ("poster_consecutive", via_poster, (consec, consec))):
            builds, transfers, totals = [], [], []
            for i in range(1 + repeats):
                t0 = time.perf_counter()
                xfer_id, done = post(li, ri)
                t_posted = time.perf_counter()
                _wait(t, xfer_id, done)
                t1 = time.perf_counter()
                timing = t.last_post
                t.release(xfer_id)
                if i:  # build: everything before transfer() (ids -> descriptors/indices)
                    builds.append(t_posted - t0 - timing.transfer_s)
                    transfers.append(timing.transfer_s)
                    totals.append(t1 - t0)
            verified = _verify(buf, li, ri, chunk)
            buf.fill(0)
            la, ra = base + li * chunk, remote_base + ri * chunk
            build, total = statistics.median(builds), statistics.median(totals)
            merged = (n if method.startswith("fresh")
                      else merged_count(la, ra, np.full(n, chunk)))
            out["cases"].append({
                "chunk_nbytes": chunk, "method": method, "descriptors": n,
                "descriptors_after_merge": merged,
                "build_ms": round(build * 1e3, 3),
                "build_us_per_descriptor": round(build * 1e6 / n, 4),
                "transfer_ms": round(statistics.median(transfers) * 1e3, 3),
                "transfer_us_per_descriptor": round(statistics.median(transfers) * 1e6 / merged,
                                                    3),
                "total_ms": round(total * 1e3, 3),
                "gbps": round(nbytes / total / 1e9, 2),
                "posting_share": round(build / total, 3),
                "verified": verified,
            })
        out["cases"][-6]["prepare_ms"] = round(prepare_s * 1e3, 3)
        t.release_prepared(local_list)
        t.release_prepared(remote_list)
    poster.close()
    t.close()
    conn.send(out)


def _memcpy_gbps(nbytes: int, repeats: int) -> float:
    src, dst = _pool(nbytes), _pool(nbytes)
    np.copyto(dst, src)
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return round(nbytes / statistics.median(times) / 1e9, 2)


def bench_posting(nbytes_mib: int = 512, chunks_kib: tuple[int, ...] = (4, 32),
                  repeats: int = 5, pool_factor: float = 1.25, seed: int = 7,
                  timeout_s: float = 300.0) -> dict[str, Any]:
    nbytes = nbytes_mib * MiB
    pool_nbytes = int(nbytes * pool_factor) // MiB * MiB
    started = time.perf_counter()
    load0 = os.getloadavg()[0]
    memcpy = _memcpy_gbps(nbytes, repeats)
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    stop = ctx.Event()
    target = ctx.Process(target=_target, args=(t_child, stop, pool_nbytes), daemon=True)
    target.start()
    initiator = None
    try:
        if not t_parent.poll(timeout_s):
            raise RuntimeError("NIXL target did not start")
        meta, remote_base = t_parent.recv()
        initiator = ctx.Process(target=_initiator, daemon=True,
                                args=(i_child, meta, remote_base, pool_nbytes, nbytes,
                                      [c * KiB for c in chunks_kib], repeats, seed))
        initiator.start()
        if not i_parent.poll(timeout_s):
            raise RuntimeError("NIXL initiator did not report")
        res = i_parent.recv()
    finally:
        end_children(stop, initiator, target)
    for case in res["cases"]:
        case["ratio_memcpy"] = round(case["gbps"] / memcpy, 3)
    return {"nbytes": nbytes, "pool_nbytes": pool_nbytes, "repeats": repeats,
            "memcpy_gbps": memcpy, "cases": res["cases"],
            "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "seconds": round(time.perf_counter() - started, 1)}


def render_posting(result: dict[str, Any]) -> str:
    cols = [("chunk", "chunk_nbytes"), ("method", "method"), ("descs", "descriptors"),
            ("merged", "descriptors_after_merge"), ("build ms", "build_ms"),
            ("us/desc", "build_us_per_descriptor"), ("transfer ms", "transfer_ms"),
            ("xfer us/desc", "transfer_us_per_descriptor"),
            ("total ms", "total_ms"), ("GB/s", "gbps"), ("x memcpy", "ratio_memcpy"),
            ("post share", "posting_share"), ("prepare ms", "prepare_ms")]
    rows = [[c for c, _ in cols]]
    for case in result["cases"]:
        row = []
        for _, key in cols:
            v = case.get(key, "")
            row.append(f"{v // KiB} KiB" if key == "chunk_nbytes" else str(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"\n{result['nbytes'] // MiB} MiB per READ, random chunk ids in pools of "
                 f"{result['pool_nbytes'] // MiB} MiB; medians of {result['repeats']}; memcpy "
                 f"{result['memcpy_gbps']} GB/s; load {result['loadavg_1m']}; "
                 f"{result['seconds']} s")
    lines.append("build: block ids -> descriptors or indices + the NIXL request "
                 "(initialize_xfer | make_prepped_xfer); transfer: transfer() (copies inline on "
                 "UCX cma); xfer us/desc: per descriptor after merging; prepare: both pools' "
                 "lists, once")
    return "\n".join(lines)
