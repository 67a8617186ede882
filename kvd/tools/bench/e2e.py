"""kvd end to end: two ``kvd serve`` processes, simulated engines, pulls timed at the client.

Throughput of a ``nbytes`` request per scenario (random and consecutive block ids,
checked byte for byte) and the latency of 1-block pulls.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.bench.floor import POOL_BLOCKS as FLOOR_MIN_PULLS
from kvd.tools.bench.floor import floor_result
from kvd.tools.bench.geometry import (
    DEFAULT_SHM_DIR,
    Geometry,
    MiB,
    Scenario,
    fmt_gbps,
    fmt_ms,
    fmt_pct,
)
from kvd.tools.bench.raw import fill_test_pattern
from kvd.tools.sim import blocks_view, layout_spec


def _zero_blocks(kvs: list[np.ndarray], geom: Geometry, block_ids: list[int]) -> None:
    for kv in kvs:
        view = blocks_view(kv, geom.kv_layout, geom.head_layout)
        for b in block_ids:
            view[b] = 0


def check_pulled_blocks(pkv: np.ndarray | list[np.ndarray], dkvs: list[np.ndarray],
                        geom: Geometry, p_ids: list[int], d_ids: list[int]) -> bool:
    """Decode rank t must hold heads [t*h, (t+1)*h) of the prefill blocks (any layout);
    ``pkv``: the prefill pool, or its TP ranks' pools in rank order (heads split)."""
    pkvs = pkv if isinstance(pkv, list) else [pkv]
    pviews = [blocks_view(k, geom.kv_layout, geom.head_layout)  # [block, L, kv, T, H, D]
              for k in pkvs]
    for t, dkv in enumerate(dkvs):
        dview = blocks_view(dkv, geom.kv_layout, geom.head_layout)
        h = dview.shape[4]
        for i in range(0, len(p_ids), 64):  # a few blocks at a time: no 512 MiB temporaries
            heads = np.concatenate([v[p_ids[i:i + 64]] for v in pviews], axis=4)
            if not np.array_equal(dview[d_ids[i:i + 64]], heads[:, :, :, :, t * h:(t + 1) * h]):
                return False
    return True


def timed_pull(pc: Any, dc: Any, prefill_addr: str, deng: str, rid: str, p_ids: list[int],
              d_ids: list[int], peng: str = "prefill") -> tuple[float, float, Any]:
    """publish -> pull -> done_recving; returns (publish..done s, pull..done s, event).

    As an engine that waits for its pull would: the publish receipt goes into the pull
    (as a router passes it), and the pull is answered when done (one round trip)."""
    t0 = time.perf_counter()
    receipt = pc.publish(peng, rid, p_ids)
    t1 = time.perf_counter()
    ev = dc.pull_and_wait(deng, rid, peng, prefill_addr, p_ids, d_ids,
                          publish_receipt=receipt, timeout_s=60)
    t2 = time.perf_counter()
    if not ev.ok:
        raise RuntimeError(f"pull {rid} failed: {ev.error}")
    sent = pc.wait(peng, rid, "done_sending", timeout_s=10)
    if not sent.ok:
        raise RuntimeError(f"producer did not release {rid}: {sent.error}")
    return t2 - t0, t2 - t1, ev


def bench_kvd(geom: Geometry, scenarios: list[Scenario], blocks: int, pool_blocks: int,
              p_ids: list[int], d_ids: list[int], repeats: int, latency_pulls: int,
              log_dir: Path, shm_dir: str = DEFAULT_SHM_DIR, concurrent_pulls: int = 16,
              daemon_args: tuple[str, ...] = (), raw: Any = None,
              floor: Callable[[], Any] | None = None) -> dict[str, Any]:
    """``raw``: a `kvd.tools.bench.raw.RawStream` to time between kvd's repeats (each
    scenario's ``nixl_shm_interleaved_ms``), or None. ``floor``: makes the
    `kvd.tools.bench.floor.FloorPipeline` whose pulls alternate with kvd's 1-block
    pulls (the floor's figures then join ``latency``), or None."""
    from kvd.tools.localcluster import DaemonProcess

    model = geom.model()
    out: dict[str, Any] = {"scenarios": {}}
    # The two daemons stand for two nodes: NIXL READs, not the host path (pool files
    # mapped between daemons of one host), unless daemon_args turn it on (the last wins).
    pools = ["--set", f"shm_dir={shm_dir}", "--set", "host_pulls=false", *daemon_args]
    prefill = DaemonProcess.start("bench-prefill", log_dir, extra_args=pools)
    decode = DaemonProcess.start("bench-decode", log_dir, extra_args=pools)
    pc, dc = prefill.client(timeout_s=30), decode.client(timeout_s=30)
    try:
        consecutive = list(range(blocks))
        for scn in scenarios:
            # the prefill engine of this scenario's TP size, its ranks' pools filled with a
            # pattern unique per byte (each rank holds its own heads)
            peng = f"prefill-tp{scn.prefill_tp}"
            pshape = geom.shape(scn.prefill_tp, pool_blocks)
            pranks = [pc.register(peng, model, layout_spec(pshape), t, scn.prefill_tp)
                      for t in range(scn.prefill_tp)]
            for t, pr in enumerate(pranks):
                fill_test_pattern(pr.kv.reshape(-1).view(np.uint8), start=t << 40)
            pkvs = [pr.kv for pr in pranks]
            deng = f"decode-tp{scn.decode_tp}"
            dshape = geom.shape(scn.decode_tp, pool_blocks)
            dranks = [dc.register(deng, model, layout_spec(dshape), t, scn.decode_tp)
                      for t in range(scn.decode_tp)]
            dkvs = [r.kv for r in dranks]
            addr = prefill.peer_address

            def pull(rid: str, src: list[int], dst: list[int]) -> tuple[float, float, Any]:
                return timed_pull(pc, dc, addr, deng, rid, src, dst, peng=peng)  # noqa: B023

            r: dict[str, Any] = {}
            # Warm-up: handshake, NIXL connection, page faults on both sides.
            t, _, ev = pull(f"{deng}-warm", p_ids, d_ids)
            r["warmup_ms"] = fmt_ms(t)
            r["verified_warmup"] = check_pulled_blocks(pkvs, dkvs, geom, p_ids, d_ids)
            totals, daemon, raw_s = [], [], []
            before = _posting(decode)
            for i in range(repeats):
                # kvd and the raw stream take turns, each first every other repeat: the
                # same background load falls on both
                if raw is not None and i % 2:
                    raw_s.append(raw.read())
                t, _, ev = pull(f"{deng}-{i}", p_ids, d_ids)
                totals.append(t)
                daemon.append(ev.duration_s)
                if raw is not None and not i % 2:
                    raw_s.append(raw.read())
            if raw_s:
                r["nixl_shm_interleaved_ms"] = [fmt_ms(x) for x in raw_s]
                r["nixl_gbps_shm_interleaved"] = fmt_gbps(raw.nbytes, statistics.median(raw_s))
            r["nbytes"] = ev.nbytes
            r["kvd_ms"] = [fmt_ms(x) for x in totals]
            r["kvd_gbps"] = fmt_gbps(ev.nbytes, statistics.median(totals))
            r["kvd_daemon_gbps"] = fmt_gbps(ev.nbytes, statistics.median(daemon))
            r.update(posting_delta(before, _posting(decode)))
            # Consecutive blocks on both sides (a fresh engine's cache): the planner merges
            # them into one descriptor per rank pair, which the READ split cuts by bytes.
            # Checked after its warm-up pull into zeroed blocks; the raw stream takes
            # turns with it as with the random pulls.
            _zero_blocks(dkvs, geom, consecutive)
            pull(f"{deng}-cwarm", consecutive, consecutive)
            r["verified_consecutive"] = check_pulled_blocks(pkvs, dkvs, geom, consecutive,
                                                            consecutive)
            ctimes, craw = [], []
            for i in range(repeats):
                if raw is not None and i % 2:
                    craw.append(raw.read())
                ctimes.append(pull(f"{deng}-c{i}", consecutive, consecutive)[0])
                if raw is not None and not i % 2:
                    craw.append(raw.read())
            r["kvd_ms_consecutive"] = [fmt_ms(x) for x in ctimes]
            r["kvd_gbps_consecutive"] = fmt_gbps(ev.nbytes, statistics.median(ctimes))
            if craw:
                r["nixl_shm_interleaved_ms_consecutive"] = [fmt_ms(x) for x in craw]
                r["nixl_gbps_shm_interleaved_consecutive"] = fmt_gbps(
                    raw.nbytes, statistics.median(craw))
            # Final check: zero the destination, pull once more, compare.
            _zero_blocks(dkvs, geom, d_ids)
            pull(f"{deng}-check", p_ids, d_ids)
            r["verified"] = r["verified_warmup"] and check_pulled_blocks(
                pkvs, dkvs, geom, p_ids, d_ids)
            out["scenarios"][scn.name] = r
            if scn.decode_tp == 1 and scn.prefill_tp == 1 and latency_pulls > 0:
                out["latency"] = _latency(pc, dc, addr, deng, p_ids[:1], d_ids[:1],
                                          latency_pulls, peng, floor)
            if scn.decode_tp == 1 and scn.prefill_tp == 1 and concurrent_pulls > 0:
                out["concurrency"] = _concurrency(pc, dc, addr, deng, peng, geom, pool_blocks,
                                                  concurrent_pulls, repeats, pkvs, dkvs)
            out["rails"] = [{"worker": r.worker, "rail": r.rail, "reads": r.reads,
                             "nbytes": r.nbytes} for r in dc.status().rails]
            for h in dranks:
                dc.deregister(h)
            for h in pranks:
                pc.deregister(h)
        return out
    finally:
        pc.close()
        dc.close()
        prefill.stop()
        decode.stop()


def _posting(daemon: Any) -> tuple[float, float, float, float, float]:
    """The decode daemon's posting counters: descriptors posted, seconds
    building NIXL requests, pulls, their total seconds, page size of its pools."""
    return (daemon.metric("kvd_descriptors_posted_total"),
            daemon.metric("kvd_pull_posting_seconds_sum"),
            daemon.metric("kvd_pull_posting_seconds_count"),
            daemon.metric("kvd_transfer_duration_seconds_sum", role="consumer"),
            daemon.metric("kvd_pool_page_bytes"))


def posting_delta(before: tuple[float, ...], after: tuple[float, ...]) -> dict[str, Any]:
    descs, build_s, posts, pull_s = (b - a for a, b in zip(before[:4], after[:4], strict=True))
    return {"kvd_post_us_per_descriptor": round(build_s / descs * 1e6, 3) if descs else None,
            "kvd_post_ms_per_pull": round(build_s / posts * 1e3, 3) if posts else None,
            "kvd_posting_share": round(build_s / pull_s, 4) if pull_s else None,
            "kvd_pool_page_bytes": int(after[4])}


def _latency(pc: Any, dc: Any, prefill_addr: str, deng: str, p_ids: list[int],
             d_ids: list[int], pulls: int, peng: str = "prefill",
             floor: Callable[[], Any] | None = None) -> dict[str, Any]:
    for i in range(max(10, pulls // 10)):
        timed_pull(pc, dc, prefill_addr, deng, f"lat-warm-{i}", p_ids, d_ids, peng)
    pipeline = floor() if floor is not None else None
    pull_s, total_s, daemon_s, floor_s = [], [], [], []
    try:
        for i in range(pulls):
            # kvd and the floor take turns pull by pull, each first every other time
            if pipeline is not None and i % 2:
                floor_s.append(pipeline.pull())
            total, pull, ev = timed_pull(pc, dc, prefill_addr, deng, f"lat-{i}", p_ids,
                                         d_ids, peng)
            pull_s.append(pull)
            total_s.append(total)
            daemon_s.append(ev.duration_s)
            if pipeline is not None and not i % 2:
                floor_s.append(pipeline.pull())
        while pipeline is not None and pipeline.pulls < FLOOR_MIN_PULLS:
            pipeline.pull()  # every block of its pool read once: then it can be checked
    finally:
        verified = pipeline.close() if pipeline is not None else None
    floor_figures = floor_result(floor_s, verified) if pipeline is not None else {}
    # daemon: the decode daemon's own pull duration (accepted -> done), without the
    # client's Pull round trip and the event's long-poll delivery.
    return {"pull_1block_p50_ms": fmt_ms(fmt_pct(pull_s, 50)),
            "pull_1block_p99_ms": fmt_ms(fmt_pct(pull_s, 99)),
            "pull_1block_daemon_p50_ms": fmt_ms(fmt_pct(daemon_s, 50)),
            "pull_1block_daemon_p99_ms": fmt_ms(fmt_pct(daemon_s, 99)),
            "pull_1block_with_publish_p50_ms": fmt_ms(fmt_pct(total_s, 50)),
            "pull_1block_nbytes": ev.nbytes, "pull_1block_samples": pulls, **floor_figures}


CONC_PULL_NBYTES = 32 * MiB


def _concurrency(pc: Any, dc: Any, addr: str, deng: str, peng: str, geom: Geometry,
                 pool_blocks: int, pulls: int, repeats: int, pkvs: list[np.ndarray],
                 dkvs: list[np.ndarray]) -> dict[str, Any]:
    """``pulls`` concurrent pulls of 32 MiB (disjoint destination blocks, issued back to
    back: aggregate bytes / first pull call -> last done_recving) against one such pull
    at a time (median), the same blocks, in one run (target: >= 0.9x)."""
    per = max(1, CONC_PULL_NBYTES // geom.block_nbytes)
    pulls = max(1, min(pulls, pool_blocks // per))
    src = random.Random(11).sample(range(pool_blocks), per)
    dst = [list(range(i * per, (i + 1) * per)) for i in range(pulls)]
    timed_pull(pc, dc, addr, deng, "conc-warm", src, dst[0], peng)
    single, agg = [], []
    for rep in range(max(3, repeats)):
        # one pull alone, then the concurrent round (taking turns, both see the same
        # background load)
        single.append(timed_pull(pc, dc, addr, deng, f"conc-1-{rep}", src, dst[0], peng)[1])
        rids = [f"conc-{pulls}-{rep}-{i}" for i in range(pulls)]
        receipts = [pc.publish(peng, rid, src) for rid in rids]
        t0 = time.perf_counter()
        for rid, d, receipt in zip(rids, dst, receipts, strict=True):
            dc.pull(deng, rid, peng, addr, src, d, publish_receipt=receipt)
        for rid in rids:
            ev = dc.wait(deng, rid, "done_recving", timeout_s=120)
            if not ev.ok:
                raise RuntimeError(f"pull {rid} failed: {ev.error}")
        agg.append(time.perf_counter() - t0)
        for rid in rids:
            pc.wait(peng, rid, "done_sending", timeout_s=30)
    nbytes = per * geom.block_nbytes
    single_gbps = fmt_gbps(nbytes, statistics.median(single))
    agg_gbps = fmt_gbps(pulls * nbytes, statistics.median(agg))
    ok = all(check_pulled_blocks(pkvs, dkvs, geom, src, d) for d in dst)
    return {"concurrent_pulls": pulls, "concurrent_pull_nbytes": nbytes,
            "single_pull_gbps": single_gbps, "concurrent_gbps": agg_gbps,
            "ratio_concurrent_vs_single": round(agg_gbps / single_gbps, 3),
            "concurrent_verified": ok}
