"""The local scenario of `kvd bench`: one daemon serves both engines, a pull is a copy.

When the consumer engine pulls from a producer engine registered with the same
``kvd serve`` (naming that daemon's own peer address, as a remote pull would), the
daemon copies the bytes itself (kvd.daemon.pull.local) with no network. Measured here,
on one daemon per copy-thread count (``--set copy_threads=N``):

- throughput of a ``nbytes`` request, DRAM pools, per scenario (TP1 -> TP1, TP1 -> TP2,
  TP4 -> TP2; fragmented block ids: a random sample of a pool 1.25x the request), as a
  ratio to a single-thread memcpy (``np.copyto``) of the same bytes between two shm
  buffers like the pools, timed **alternately** with the pulls: memcpy, pull, memcpy,
  pull, ..., memcpy. Pull i is compared with the mean of the memcpys either side of it
  (`alternated_ratios`) and the figure is the median of those ratios, so both see the
  same background load on a shared host. Between each pull and the next memcpy, the
  bare copy primitive runs too: `LocalCopier` (as many copy threads) in this process
  on the same descriptors (``geometry.kvd_descriptors``) between two shm buffers, so
  that a shortfall splits into the copy itself and the daemon's per-pull work (its own
  accepted -> done time is reported as well). Each scenario's bytes are checked after the
  warm-up pull and once more at the end (destination zeroed first); the daemon's own
  status must show the pulls took the local path.
- 1-block pull latency: a local pull (consumer on the producer's daemon) and a pull
  between two daemons on this host (consumer on a second daemon), of the same producer
  block, alternating pull by pull; p50/p99 of each and the ratio of the p50s.

`summarize_throughput`, `summarize_latency` and `local_targets` are the arithmetic,
kept free of daemons so that they can be tested alone.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.bench.e2e import check_pulled_blocks, timed_pull
from kvd.tools.bench.geometry import (
    DEFAULT_SHM_DIR,
    Geometry,
    MiB,
    Scenario,
    gbps,
    ms,
    pct,
)
from kvd.tools.bench.raw import alloc_buffer, fill_test_pattern

# The targets for a pull inside one daemon: fragmented TP1 -> TP1 >= 0.9x a
# single-thread memcpy of the same bytes, hetero TP (default layout) >= 0.7x, 1-block
# p50 <= 0.5x the 1-block pull between two daemons on the same host.
TARGET_LOCAL_FRAGMENTED = 0.9
TARGET_LOCAL_HETERO = 0.7
TARGET_LOCAL_1BLOCK_RATIO = 0.5

LOCAL_TP1_TP1 = Scenario("local_tp1_tp1", 1, 1)
LOCAL_TP1_TP2 = Scenario("local_tp1_tp2", 1, 2)
LOCAL_TP4_TP2 = Scenario("local_tp4_tp2", 4, 2)
LOCAL_SCENARIOS = (LOCAL_TP1_TP1, LOCAL_TP1_TP2, LOCAL_TP4_TP2)
# Copy threads compared (the daemon's default, copy_threads=2, last: the latency pairs
# run on it). One more than the host has cores measures contention, not the copier.
COPY_THREADS = (1, 2)
# A pull of 512 MiB takes ~40 ms here: more repeats than the remote scenarios cost little
# and steady the median on a shared host.
MIN_REPEATS = 9
LATENCY_POOL_BLOCKS = 8


# ------------------------------------------------------------------ arithmetic


def alternated_ratios(memcpy_s: list[float], pull_s: list[float]) -> list[float]:
    """Speed of pull i over the speed of memcpy around it: memcpy and pulls ran
    alternately, ``memcpy_s[i]`` just before pull i and ``memcpy_s[i + 1]`` just after
    (so ``len(memcpy_s) == len(pull_s) + 1``). Same bytes, so the speed ratio is
    mean(memcpy_s[i], memcpy_s[i + 1]) / pull_s[i]."""
    if len(memcpy_s) != len(pull_s) + 1:
        raise ValueError(f"need one memcpy before and after each pull: {len(memcpy_s)} "
                         f"memcpys for {len(pull_s)} pulls")
    if not pull_s or min(pull_s) <= 0 or min(memcpy_s) <= 0:
        raise ValueError("need at least one pull, all times > 0")
    return [(memcpy_s[i] + memcpy_s[i + 1]) / 2 / p for i, p in enumerate(pull_s)]


def summarize_throughput(nbytes: int, memcpy_s: list[float], pull_s: list[float],
                         daemon_s: list[float]) -> dict[str, Any]:
    """One scenario's figures from alternated timings (`alternated_ratios`); ``daemon_s``:
    the daemon's own duration of each pull (accepted -> done), without the client's
    round trips."""
    ratios = alternated_ratios(memcpy_s, pull_s)
    return {"memcpy_gbps": gbps(nbytes, statistics.median(memcpy_s)),
            "local_gbps": gbps(nbytes, statistics.median(pull_s)),
            "local_daemon_gbps": gbps(nbytes, statistics.median(daemon_s)) if daemon_s else None,
            "ratio_local_memcpy": round(statistics.median(ratios), 3),
            "ratio_local_memcpy_min": round(min(ratios), 3),
            "ratio_local_memcpy_max": round(max(ratios), 3),
            "memcpy_ms": [ms(x) for x in memcpy_s],
            "local_ms": [ms(x) for x in pull_s],
            "samples": len(pull_s)}


def summarize_latency(local_s: list[float], remote_s: list[float],
                      local_daemon_s: list[float] | None = None,
                      remote_daemon_s: list[float] | None = None) -> dict[str, Any]:
    """1-block pulls: p50/p99 of the local and the two-daemon pull (pull call ->
    done_recving at the client) and the ratio of their p50s."""
    if not local_s or not remote_s:
        raise ValueError("need local and two-daemon samples")
    out: dict[str, Any] = {
        "local_p50_ms": ms(pct(local_s, 50)), "local_p99_ms": ms(pct(local_s, 99)),
        "two_daemons_p50_ms": ms(pct(remote_s, 50)),
        "two_daemons_p99_ms": ms(pct(remote_s, 99)),
        "ratio_local_two_daemons_p50": round(pct(local_s, 50) / pct(remote_s, 50), 3),
        "samples": min(len(local_s), len(remote_s))}
    if local_daemon_s:
        out["local_daemon_p50_ms"] = ms(pct(local_daemon_s, 50))
    if remote_daemon_s:
        out["two_daemons_daemon_p50_ms"] = ms(pct(remote_daemon_s, 50))
    return out


def local_targets(local: dict[str, Any]) -> dict[str, bool]:
    """Which targets one run met, per copy-thread count: TP1 -> TP1 >= 0.9x memcpy,
    every hetero scenario >= 0.7x, the 1-block ratio <= 0.5 (a scenario not run counts
    as met only if it was skipped on purpose: absent from ``local['rows']``)."""
    met: dict[str, bool] = {}
    for threads in sorted({r["copy_threads"] for r in local["rows"]}):
        rows = [r for r in local["rows"] if r["copy_threads"] == threads]
        homog = [r for r in rows if r["prefill_tp"] == r["decode_tp"]]
        hetero = [r for r in rows if r["prefill_tp"] != r["decode_tp"]]
        met[f"local_fragmented_t{threads}"] = bool(homog) and all(
            r["ratio_local_memcpy"] >= TARGET_LOCAL_FRAGMENTED for r in homog)
        met[f"local_hetero_t{threads}"] = all(
            r["ratio_local_memcpy"] >= TARGET_LOCAL_HETERO for r in hetero)
    lat = local.get("latency") or {}
    met["local_1block_p50_ratio"] = (lat.get("ratio_local_two_daemons_p50") is not None
                                     and lat["ratio_local_two_daemons_p50"]
                                     <= TARGET_LOCAL_1BLOCK_RATIO)
    return met


def local_verified(local: dict[str, Any]) -> bool:
    rows = local.get("rows", [])
    lat = local.get("latency") or {}
    return (bool(rows) and all(r["verified"] and r["path"] == "local" for r in rows)
            and bool(lat.get("verified")))


# ------------------------------------------------------------------ measuring


class CopierTimer:
    """The copy primitive alone: `kvd.transport.copies.localcopy.LocalCopier` (the daemon's
    copier, ``threads`` copy threads) copying one pull's descriptors between two shm
    buffers like the pools, in this process; no daemon, no messages."""

    def __init__(self, geom: Geometry, scn: Scenario, pool_blocks: int, p_ids: list[int],
                 d_ids: list[int], threads: int, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        from kvd.daemon.pull.local import local_copier
        from kvd.tools.bench.geometry import kvd_descriptors

        lo, ro, nb, lbytes, rbytes = kvd_descriptors(geom, scn, pool_blocks, pool_blocks,
                                                     p_ids, d_ids)
        self._src, self._src_pool = alloc_buffer("shm", rbytes, shm_dir)
        self._dst, self._dst_pool = alloc_buffer("shm", lbytes, shm_dir)
        self._src.fill(1)
        self._dst.fill(0)
        self._copier = local_copier(threads)
        self._args = (lo.astype(np.uint64) + self._dst.ctypes.data,
                      ro.astype(np.uint64) + self._src.ctypes.data, nb.astype(np.uint64))
        self.descriptors = len(nb)
        self.time()  # warm

    def time(self) -> float:
        t0 = time.perf_counter()
        handle = self._copier.post(*self._args)
        self._copier.wait(handle, 60)
        seconds = time.perf_counter() - t0
        self._copier.release(handle)
        return seconds

    def close(self) -> None:
        self._copier.close()
        del self._src, self._dst
        for pool in (self._src_pool, self._dst_pool):
            if pool is not None:
                pool.close()


class MemcpyTimer:
    """A single-thread memcpy (``np.copyto``) of ``nbytes`` between two shm buffers like
    the daemons' pools (`kvd.tools.bench.raw.alloc_buffer`), pre-faulted; the baseline
    the local pulls alternate with."""

    def __init__(self, nbytes: int, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        self.nbytes = nbytes
        self._src, self._src_pool = alloc_buffer("shm", nbytes, shm_dir)
        self._dst, self._dst_pool = alloc_buffer("shm", nbytes, shm_dir)
        self._src.fill(1)
        self._dst.fill(0)
        np.copyto(self._dst, self._src)  # warm

    def time(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self._dst, self._src)
        return time.perf_counter() - t0

    def close(self) -> None:
        del self._src, self._dst
        for pool in (self._src_pool, self._dst_pool):
            if pool is not None:
                pool.close()


def _pull_path(client: Any, request_id: str) -> str | None:
    """The path (local / remote) the daemon reports for a finished pull."""
    for p in client.status().finished_pulls:
        if p.request_id == request_id:
            return p.path
    return None


def _throughput(c: Any, addr: str, geom: Geometry, scn: Scenario, pool_blocks: int,
                p_ids: list[int], d_ids: list[int], repeats: int,
                memcpy: MemcpyTimer, copier: CopierTimer | None = None) -> dict[str, Any]:
    from kvd.tools.sim import layout_spec

    model = geom.model()
    peng, deng = f"lprefill-tp{scn.prefill_tp}", f"ldecode-tp{scn.decode_tp}"
    pranks = [c.register(peng, model, layout_spec(geom.shape(scn.prefill_tp, pool_blocks)),
                         t, scn.prefill_tp) for t in range(scn.prefill_tp)]
    dranks = []
    try:
        for t, pr in enumerate(pranks):
            fill_test_pattern(pr.kv.reshape(-1).view(np.uint8), start=t << 40)
        dranks = [c.register(deng, model, layout_spec(geom.shape(scn.decode_tp, pool_blocks)),
                             t, scn.decode_tp) for t in range(scn.decode_tp)]
        pkvs, dkvs = [r.kv for r in pranks], [r.kv for r in dranks]

        def pull(rid: str) -> tuple[float, float, Any]:
            return timed_pull(c, c, addr, deng, rid, p_ids, d_ids, peng=peng)

        warm_s, _, ev = pull(f"{deng}-warm")  # page faults of the new pools
        verified = check_pulled_blocks(pkvs, dkvs, geom, p_ids, d_ids)
        memcpy_s, pull_s, daemon_s, copy_s = [memcpy.time()], [], [], []
        for i in range(repeats):
            t, _, ev = pull(f"{deng}-{i}")
            pull_s.append(t)
            daemon_s.append(ev.duration_s)
            if copier is not None:
                copy_s.append(copier.time())
            memcpy_s.append(memcpy.time())
        for kv in dkvs:
            kv.fill(0)
        pull(f"{deng}-check")
        verified = verified and check_pulled_blocks(pkvs, dkvs, geom, p_ids, d_ids)
        row = {"name": scn.name, "prefill_tp": scn.prefill_tp, "decode_tp": scn.decode_tp,
               "nbytes": ev.nbytes, "block_ids": "random sample (fragmented cache)",
               "path": _pull_path(c, f"{deng}-check"), "warmup_ms": ms(warm_s),
               "verified": verified}
        row.update(summarize_throughput(ev.nbytes, memcpy_s, pull_s, daemon_s))
        if copy_s:
            row["copier_gbps"] = gbps(ev.nbytes, statistics.median(copy_s))
            row["ratio_copier_memcpy"] = round(statistics.median(
                alternated_ratios(memcpy_s, copy_s)), 3)
            row["copier_descriptors"] = copier.descriptors if copier is not None else None
        return row
    finally:
        for h in dranks + pranks:
            c.deregister(h)


def _latency(a: Any, a_addr: str, b: Any, geom: Geometry, pulls: int) -> dict[str, Any]:
    """1-block pulls of one producer block on daemon A, by a consumer on A (local) and
    one on daemon B (two daemons, same host), alternating, each first every other time."""
    from kvd.tools.sim import layout_spec

    model = geom.model()
    spec = layout_spec(geom.shape(1, LATENCY_POOL_BLOCKS))
    prod = a.register("lat-prefill", model, spec, 0, 1)
    near = far = None
    try:
        fill_test_pattern(prod.kv.reshape(-1).view(np.uint8))
        near = a.register("lat-decode-local", model, spec, 0, 1)
        far = b.register("lat-decode-remote", model, spec, 0, 1)
        src, dst = [3], [5]

        def local(rid: str) -> tuple[float, float, Any]:
            return timed_pull(a, a, a_addr, "lat-decode-local", rid, src, dst, "lat-prefill")

        def remote(rid: str) -> tuple[float, float, Any]:
            return timed_pull(a, b, a_addr, "lat-decode-remote", rid, src, dst, "lat-prefill")

        for i in range(max(10, pulls // 10)):  # handshake, connection, page faults
            local(f"lat-lw{i}")
            remote(f"lat-rw{i}")
        local_s, remote_s, local_d, remote_d = [], [], [], []
        for i in range(pulls):
            order = ((local, local_s, local_d, "l"), (remote, remote_s, remote_d, "r"))
            for fn, out, dout, tag in (order if i % 2 == 0 else order[::-1]):
                _, pull_s, ev = fn(f"lat-{tag}{i}")
                out.append(pull_s)
                dout.append(ev.duration_s)
        for kv in (near.kv, far.kv):
            kv.fill(0)
        local("lat-lcheck")
        remote("lat-rcheck")
        verified = (check_pulled_blocks(prod.kv, [near.kv], geom, src, dst)
                    and check_pulled_blocks(prod.kv, [far.kv], geom, src, dst)
                    and _pull_path(a, "lat-lcheck") == "local"
                    and _pull_path(b, "lat-rcheck") == "remote")
        out = summarize_latency(local_s, remote_s, local_d, remote_d)
        out.update({"nbytes": ev.nbytes, "verified": verified})
        return out
    finally:
        if far is not None:
            b.deregister(far)
        if near is not None:
            a.deregister(near)
        a.deregister(prod)


def bench_local(geom: Geometry, blocks: int, pool_blocks: int, p_ids: list[int],
                d_ids: list[int], repeats: int, latency_pulls: int, log_dir: Path,
                shm_dir: str = DEFAULT_SHM_DIR,
                scenarios: tuple[Scenario, ...] = LOCAL_SCENARIOS,
                copy_threads: tuple[int, ...] = COPY_THREADS) -> dict[str, Any]:
    """The local scenario (module docstring): one daemon per copy-thread count; the
    latency pairs on the last one, with a second daemon for the two-daemon pulls."""
    from kvd.tools.localcluster import DaemonProcess

    # The second daemon stands for another node: its pulls are NIXL READs, not the host
    # path (pool files mapped between daemons of one host).
    pools = ["--set", f"shm_dir={shm_dir}", "--set", "host_pulls=false"]
    repeats = max(repeats, MIN_REPEATS)
    rows: list[dict[str, Any]] = []
    latency: dict[str, Any] = {}
    memcpy = MemcpyTimer(blocks * geom.block_nbytes, shm_dir)
    try:
        for n, threads in enumerate(copy_threads):
            d = DaemonProcess.start(f"bench-local-t{threads}", log_dir,
                                    extra_args=[*pools, "--set", f"copy_threads={threads}"])
            c = d.client(timeout_s=30)
            try:
                for scn in scenarios:
                    copier = CopierTimer(geom, scn, pool_blocks, p_ids, d_ids, threads, shm_dir)
                    try:
                        row = _throughput(c, d.peer_address, geom, scn, pool_blocks, p_ids,
                                          d_ids, repeats, memcpy, copier)
                    finally:
                        copier.close()
                    row["copy_threads"] = threads
                    rows.append(row)
                if n == len(copy_threads) - 1 and latency_pulls > 0:
                    b = DaemonProcess.start("bench-local-peer", log_dir, extra_args=pools)
                    bc = b.client(timeout_s=30)
                    try:
                        latency = _latency(c, d.peer_address, bc, geom, latency_pulls)
                        latency["copy_threads"] = threads
                    finally:
                        bc.close()
                        b.stop()
            finally:
                c.close()
                d.stop()
    finally:
        memcpy.close()
    local = {"rows": rows, "latency": latency, "repeats": repeats,
             "memcpy": "np.copyto, one thread, shm buffers like the pools, alternating with "
                       "the pulls",
             "targets": {"ratio_local_memcpy_fragmented_min": TARGET_LOCAL_FRAGMENTED,
                         "ratio_local_memcpy_hetero_min": TARGET_LOCAL_HETERO,
                         "ratio_local_1block_p50_max": TARGET_LOCAL_1BLOCK_RATIO}}
    local["targets"]["met"] = local_targets(local)
    return local


def render_local(local: dict[str, Any]) -> str:
    cols = [("local scenario", "name", "{}"), ("copy thr.", "copy_threads", "{}"),
            ("MiB", "nbytes", "{:.0f}"), ("memcpy", "memcpy_gbps", "{:.2f}"),
            ("local", "local_gbps", "{:.2f}"), ("in daemon", "local_daemon_gbps", "{:.2f}"),
            ("local/memcpy", "ratio_local_memcpy", "{:.2f}"),
            ("min", "ratio_local_memcpy_min", "{:.2f}"),
            ("max", "ratio_local_memcpy_max", "{:.2f}"),
            ("copier", "copier_gbps", "{:.2f}"), ("copier/memcpy", "ratio_copier_memcpy", "{:.2f}"),
            ("path", "path", "{}"),
            ("verified", "verified", "{}")]
    table = [[c[0] for c in cols]]
    for r in local["rows"]:
        vals = [r[k] / MiB if k == "nbytes" else r.get(k) for _, k, _ in cols]
        table.append(["-" if v is None else f.format(v)
                      for v, (_, _, f) in zip(vals, cols, strict=True)])
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lat = local.get("latency") or {}
    lines.append(f"local: one daemon, producer and consumer engines both on it; GB/s medians "
                 f"of {local['repeats']}; local/memcpy: median of per-pull ratios to a "
                 "single-thread memcpy timed alternately with the pulls; in daemon: its own "
                 "accepted -> done; copier: the copy primitive alone in this process, same "
                 "descriptors and copy threads")
    if lat:
        lines.append(
            f"1-block ({lat['nbytes'] / MiB:.1f} MiB) local pull p50 {lat['local_p50_ms']} ms "
            f"p99 {lat['local_p99_ms']} ms; two daemons on this host p50 "
            f"{lat['two_daemons_p50_ms']} ms p99 {lat['two_daemons_p99_ms']} ms "
            f"(alternating, {lat['samples']} each); local/two daemons p50 "
            f"x{lat['ratio_local_two_daemons_p50']}")
    met = local["targets"]["met"]
    lines.append("local targets: " + "; ".join(f"{k}: {'met' if v else 'MISSED'}"
                                              for k, v in met.items()))
    return "\n".join(lines)
