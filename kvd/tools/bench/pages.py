"""Page size vs transfer speed: memcpy and raw NIXL READ on each pool backing, one run.

For each memory kind, a fresh pair of spawned processes (so that only one kind's
buffers exist at a time, and huge-page reservations can be small):

* ``anon``: numpy heap memory (numpy asks for transparent huge pages on big arrays);
* ``shm``: a pool file in ``shm_dir`` as kvd always made it (4 KiB pages on a plain
  /dev/shm);
* ``tmpfs_huge``: a pool file in a tmpfs mounted ``huge=always`` (``huge_tmpfs_dir``);
* ``hugetlbfs``: a pool file in a hugetlbfs mount (``hugetlbfs_dir``);
* ``memfd_hugetlb``: a memfd from the reserved 2 MiB pages.

Per kind: memcpy between two buffers of that kind (this process), a NIXL READ of one
``nbytes`` descriptor, and of ``chunk``-byte pieces at random ids (the shape of kvd's
kv_split pull, through prepared lists); what actually backs the buffers (smaps:
huge-page kB) is reported next to it, so a silent 4 KiB fallback shows. Kinds the
host does not offer are reported as skipped with the reason.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from kvd.tools.bench.raw import check_test_pattern, end_children, fill_test_pattern

MiB = 1 << 20
KiB = 1 << 10
# The target polls NIXL (progress, notifications) every TARGET_POLL_S seconds, sleeping in
# between: a READ completes only once the target has progressed it, even without a
# notification (measured: a 512 MiB READ to a target that never polls never finishes),
# and a target spinning flat out competes with the copy on 2 cores. 0: spin.
TARGET_POLL_S = float(os.environ.get("KVD_BENCH_TARGET_POLL_S", "0.0002"))
KINDS = ("anon", "shm", "tmpfs_huge", "hugetlbfs", "memfd_hugetlb")


def _alloc(kind: str, nbytes: int, dirs: dict[str, str]) -> tuple[np.ndarray, Any]:
    """(uint8 buffer, owner to close): anon or a kvd pool of that backing, unlinked at once."""
    if kind == "anon":
        return np.empty(nbytes, dtype=np.uint8), None
    from kvd.pool.shm import PoolBacking, ShmPool

    backing = {"shm": PoolBacking.SHM, "tmpfs_huge": PoolBacking.TMPFS_HUGE,
               "hugetlbfs": PoolBacking.HUGETLBFS,
               "memfd_hugetlb": PoolBacking.MEMFD_HUGETLB}[kind]
    pool = ShmPool.create("kvd-pagebench", nbytes, dirs.get(kind, "/dev/shm"), backing=backing)
    if pool.fd is None:
        os.unlink(pool.directory / pool.name)
    return pool.array, pool


def _huge_kb(buf: np.ndarray) -> dict[str, int]:
    from kvd.pool.shm import page_stats

    s = page_stats(int(buf.ctypes.data), buf.nbytes)
    huge = (s["AnonHugePages"] + s["ShmemPmdMapped"] + s["FilePmdMapped"]
            + s["Shared_Hugetlb"] + s["Private_Hugetlb"])
    return {"rss_kb": s["Rss"] + s["Shared_Hugetlb"] + s["Private_Hugetlb"],
            "huge_kb": huge, "kernel_page_kb": s["KernelPageSize"]}


def _memcpy(kind: str, nbytes: int, repeats: int, dirs: dict[str, str]) -> dict[str, Any]:
    src, sp = _alloc(kind, nbytes, dirs)
    dst, dp = _alloc(kind, nbytes, dirs)
    src.fill(1)
    dst.fill(0)
    np.copyto(dst, src)
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    pages = _huge_kb(dst)
    del src, dst
    for p in (sp, dp):
        if p is not None:
            p.close()
    return {"memcpy_gbps": round(nbytes / statistics.median(times) / 1e9, 2), **pages}


def _target(conn: Any, stop: Any, kind: str, nbytes: int, dirs: dict[str, str]) -> None:
    from kvd.transport.remote.nixl import NixlTransport

    t = NixlTransport(name=f"pages-target-{os.getpid()}")
    buf, owner = _alloc(kind, nbytes, dirs)
    fill_test_pattern(buf)
    t.register(int(buf.ctypes.data), nbytes, "DRAM", 0)
    conn.send((t.metadata(), int(buf.ctypes.data), _huge_kb(buf)))
    while not stop.is_set():  # progress + notifications, sleeping in between (see top)
        t.notifications()
        if TARGET_POLL_S:
            time.sleep(TARGET_POLL_S)
    t.close()
    del buf
    if owner is not None:
        owner.close()


def _initiator(conn: Any, meta: bytes, remote_base: int, kind: str, nbytes: int, chunk: int,
               repeats: int, dirs: dict[str, str], seed: int) -> None:
    from kvd.transport.base import DescRows, PreppedRead
    from kvd.transport.remote.nixl import NixlTransport

    t = NixlTransport(name=f"pages-init-{os.getpid()}")
    buf, owner = _alloc(kind, nbytes, dirs)
    buf.fill(0xFF)
    base = int(buf.ctypes.data)
    t.register(base, nbytes, "DRAM", 0)
    peer = t.add_peer(meta)
    out: dict[str, Any] = {}
    n = nbytes // chunk
    rng = np.random.default_rng(seed)
    cases = {
        "one": (t.prepare_local(DescRows.grid(base, nbytes, 1)),
                t.prepare_remote(peer, DescRows.grid(remote_base, nbytes, 1)),
                np.zeros(1, np.int32), np.zeros(1, np.int32)),
        "chunks": (t.prepare_local(DescRows.grid(base, chunk, n)),
                   t.prepare_remote(peer, DescRows.grid(remote_base, chunk, n)),
                   rng.permutation(n).astype(np.int32), rng.permutation(n).astype(np.int32)),
    }
    for name, (ll, rl, li, ri) in cases.items():
        times = []
        for i in range(1 + repeats):
            t0 = time.perf_counter()
            xfer, done = t.post_prepped_read(PreppedRead(peer, ll, rl, li, ri, b"p"))
            while not done:
                done = t.poll(xfer)
            if i:
                times.append(time.perf_counter() - t0)
            t.release(xfer)
        out[f"nixl_{name}_gbps"] = round(nbytes / statistics.median(times) / 1e9, 2)
        if name == "one":
            out["verified"] = check_test_pattern(buf)
    out["initiator_pages"] = _huge_kb(buf)
    t.close()
    del buf
    if owner is not None:
        owner.close()
    conn.send(out)


def _available(kind: str, nbytes: int, dirs: dict[str, str]) -> str | None:
    """None when the kind can be measured here, else why not."""
    from kvd.pool.shm import hugepages_free_nbytes, mount_of

    if kind in ("tmpfs_huge", "hugetlbfs"):
        d = dirs.get(kind)
        m = mount_of(d) if d else None
        if m is None or (kind == "hugetlbfs" and not m.is_hugetlbfs) or (
                kind == "tmpfs_huge" and not m.is_huge_tmpfs):
            return f"no {kind} directory given (--{kind.replace('_', '-')}-dir)"
    if kind in ("hugetlbfs", "memfd_hugetlb") and hugepages_free_nbytes() < 2 * nbytes:
        return (f"needs {2 * nbytes // MiB} MiB of reserved huge pages, "
                f"{hugepages_free_nbytes() // MiB} MiB free (vm.nr_hugepages)")
    return None


def _nixl(kind: str, nbytes: int, chunk: int, repeats: int, dirs: dict[str, str],
          seed: int, timeout_s: float = 300.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    stop = ctx.Event()
    target = ctx.Process(target=_target, args=(t_child, stop, kind, nbytes, dirs), daemon=True)
    target.start()
    initiator = None
    try:
        if not t_parent.poll(timeout_s):
            raise RuntimeError("NIXL target did not start")
        meta, remote_base, target_pages = t_parent.recv()
        initiator = ctx.Process(target=_initiator, daemon=True,
                                args=(i_child, meta, remote_base, kind, nbytes, chunk, repeats,
                                      dirs, seed))
        initiator.start()
        if not i_parent.poll(timeout_s):
            raise RuntimeError("NIXL initiator did not report")
        res = i_parent.recv()
        res["target_pages"] = target_pages
        return res
    finally:
        end_children(stop, initiator, target)


def bench_pages(nbytes_mib: int = 512, chunk_kib: int = 32, repeats: int = 5,
                kinds: tuple[str, ...] = KINDS, shm_dir: str = "/dev/shm",
                huge_tmpfs_dir: str | None = None, hugetlbfs_dir: str | None = None,
                seed: int = 7, rounds: int = 1) -> dict[str, Any]:
    """``rounds``: measure every kind that many times, rotating the order, and report the
    median per figure: on a shared box, load changes within a run, and this spreads it
    over all kinds instead of penalising whichever ran during a busy spell."""
    nbytes = nbytes_mib * MiB
    dirs = {"shm": shm_dir}
    if huge_tmpfs_dir:
        dirs["tmpfs_huge"] = huge_tmpfs_dir
    if hugetlbfs_dir:
        dirs["hugetlbfs"] = hugetlbfs_dir
    started = time.perf_counter()
    load0 = os.getloadavg()[0]
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    skipped = {k: why for k in kinds if (why := _available(k, nbytes, dirs)) is not None}
    todo = [k for k in kinds if k not in skipped]
    for r in range(max(1, rounds)):
        for kind in todo[r % len(todo):] + todo[:r % len(todo)] if todo else []:
            row: dict[str, Any] = {"kind": kind, **_memcpy(kind, nbytes, repeats, dirs)}
            row.update(_nixl(kind, nbytes, chunk_kib * KiB, repeats, dirs, seed))
            samples[kind].append(row)
    rows = []
    for kind in kinds:
        if kind in skipped:
            rows.append({"kind": kind, "skipped": skipped[kind]})
            continue
        runs = samples[kind]
        row = dict(runs[-1])
        for key in ("memcpy_gbps", "nixl_one_gbps", "nixl_chunks_gbps"):
            row[key] = round(statistics.median(x[key] for x in runs), 2)
            row[key + "_rounds"] = [x[key] for x in runs]
            row[key + "_best"] = max(x[key] for x in runs)
        row["verified"] = all(x["verified"] for x in runs)
        rows.append(row)
    anon = next((r for r in rows if r["kind"] == "anon" and "skipped" not in r), None)
    for r in rows:
        if anon and "skipped" not in r:
            r["ratio_nixl_one_vs_anon_memcpy"] = round(r["nixl_one_gbps"] / anon["memcpy_gbps"],
                                                       3)
            r["ratio_nixl_chunks_vs_anon_memcpy"] = round(
                r["nixl_chunks_gbps"] / anon["memcpy_gbps"], 3)
    return {"nbytes": nbytes, "chunk_nbytes": chunk_kib * KiB, "repeats": repeats,
            "rounds": max(1, rounds), "kinds": rows, "dirs": dirs, "loadavg_1m": [round(load0, 2),
                                                         round(os.getloadavg()[0], 2)],
            "seconds": round(time.perf_counter() - started, 1)}


def render_pages(result: dict[str, Any]) -> str:
    chunk = result["chunk_nbytes"] // KiB
    cols = [("kind", "kind"), ("memcpy", "memcpy_gbps"), ("nixl 1 desc", "nixl_one_gbps"),
            (f"nixl {chunk} KiB x n", "nixl_chunks_gbps"),
            ("1 desc / anon memcpy", "ratio_nixl_one_vs_anon_memcpy"),
            (f"{chunk} KiB / anon memcpy", "ratio_nixl_chunks_vs_anon_memcpy"),
            ("huge MiB / rss MiB", "pages"), ("ok", "verified")]
    rows = [[c for c, _ in cols]]
    for r in result["kinds"]:
        if "skipped" in r:
            rows.append([r["kind"], f"skipped: {r['skipped']}"] + [""] * (len(cols) - 2))
            continue
        row = []
        for _, key in cols:
            if key == "pages":
                row.append(f"{r['huge_kb'] // 1024} / {r['rss_kb'] // 1024}")
            elif f"{key}_best" in r and result.get("rounds", 1) > 1:
                row.append(f"{r[key]} ({r[key + '_best']})")
            else:
                row.append(str(r.get(key, "")))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows if len(r) > i and not r[1].startswith("skipped"))
              for i in range(len(cols))]
    lines = []
    for r in rows:
        if r[1].startswith("skipped"):
            lines.append(f"{r[0].rjust(widths[0])}  {r[1]}")
        else:
            lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"\nGB/s, {result['nbytes'] // MiB} MiB, medians of {result['repeats']} "
                 f"x {result.get('rounds', 1)} rounds (kinds rotated; median of rounds, "
                 "best in brackets); "
                 f"NIXL READ between two processes through prepared lists; {chunk} KiB pieces "
                 f"at random ids; huge MiB: of the memcpy destination (smaps); load "
                 f"{result['loadavg_1m']}; {result['seconds']} s")
    return "\n".join(lines)
