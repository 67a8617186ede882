"""The bench's output: machine description, the JSON result, targets, the text table."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.bench.geometry import (
    DEFAULT_SHM_DIR,
    TARGET_FLOOR_P50,
    TARGET_FLOOR_P99,
    TARGET_P50_MS,
    TARGET_P99_MS,
    TARGET_RATIO_CONCURRENT,
    TARGET_RATIO_HETERO_MEMCPY,
    TARGET_RATIO_KVD_MEMCPY,
    TARGET_RATIO_KVD_NIXL,
    TARGET_RATIO_SINGLE_STREAM,
    Geometry,
    MiB,
    Scenario,
    fmt_gbps,
    fmt_ms,
)


def _mount_of(path: str) -> str | None:
    """``fstype options`` of the mount holding ``path`` (huge pages or not), from /proc/mounts."""
    real, best, found = os.path.realpath(path), "", None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, found = mnt, f"{parts[2]} {parts[3]}"
    except OSError:
        return None
    return found


def machine_info(shm_dir: str = DEFAULT_SHM_DIR) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl-cu12")
    except Exception:  # noqa: BLE001
        info["nixl"] = None
    info["ucx_tls"] = os.environ.get("UCX_TLS", "(default)")
    info["shm_dir"] = shm_dir  # where every "shm" buffer and both daemons' pools live
    info["shm_mount"] = _mount_of(shm_dir)
    # Page size the pools get in shm_dir (kvd.pool.shm: 2 MiB on hugetlbfs / huge tmpfs, else
    # 4 KiB) and the reserved huge pages free for memfd pools (pool_backing=auto).
    from kvd.pool.shm import hugepages_free_nbytes, mount_of, page_nbytes_of_dir

    info["shm_page_nbytes"] = page_nbytes_of_dir(Path(shm_dir), mount_of(shm_dir))
    info["hugepages_free_mib"] = hugepages_free_nbytes() >> 20
    info["loadavg_1m_start"] = round(os.getloadavg()[0], 2)
    return info


def build_result(geom: Geometry, scenarios: list[Scenario], nbytes: int, repeats: int,
                 memcpy: dict[str, Any], nixl: dict[str, Any], kvd: dict[str, Any],
                 ndesc: dict[str, int], desc_nbytes: dict[str, int],
                 machine: dict[str, Any], logs: Path, started: float) -> dict[str, Any]:
    """The JSON of one run from the raw measurements of each phase."""
    nixl_best = fmt_gbps(nbytes, statistics.median(nixl["single"]))
    out_scn = []
    for scn in scenarios:
        k = kvd["scenarios"][scn.name]
        same = statistics.median(nixl[scn.name])
        separate = fmt_gbps(nbytes, statistics.median(nixl["single:shm"]))
        # the best single stream timed between kvd's repeats (same background load)
        stream = k.get("nixl_gbps_shm_interleaved") or separate
        out_scn.append({
            "name": scn.name,
            "prefill_tp": scn.prefill_tp,
            "decode_tp": scn.decode_tp,
            "nbytes": nbytes,
            "memcpy_gbps": memcpy["memcpy_gbps"],
            "nixl_gbps": nixl_best,
            "kvd_gbps": k["kvd_gbps"],
            "ratio_kvd_memcpy": round(k["kvd_gbps"] / memcpy["memcpy_gbps"], 3),
            "ratio_kvd_nixl": round(k["kvd_gbps"] / nixl_best, 3),
            "block_ids": "random sample (fragmented cache)",
            "descriptors": ndesc[scn.name],
            "descriptor_nbytes_median": desc_nbytes[scn.name],
            "nixl_descriptors": 1,
            "nixl_gbps_shm": fmt_gbps(nbytes, statistics.median(nixl["single:shm"])),
            "nixl_gbps_kvd_descriptors": fmt_gbps(nbytes, same),
            "nixl_gbps_kvd_descriptors_shm": fmt_gbps(
                nbytes, statistics.median(nixl[scn.name + ":shm"])),
            "nixl_post_ms_kvd_descriptors": fmt_ms(statistics.median(nixl[scn.name + ":post"])),
            # kvd against raw NIXL moving the same descriptors on the same kind of memory:
            # what kvd itself costs (the rest is NIXL/UCX and 4 KiB shm pages).
            "ratio_kvd_nixl_same_descriptors_shm": round(
                k["kvd_gbps"] / fmt_gbps(nbytes, statistics.median(nixl[scn.name + ":shm"])), 3),
            # kvd against the best single-descriptor READ on the same
            # memory (shm pools allocated like kvd's), that READ timed between kvd's
            # repeats (the raw stream and kvd alternate: both see the same background
            # load); "_separate": against the same READ timed before kvd started.
            "nixl_gbps_shm_interleaved": k.get("nixl_gbps_shm_interleaved"),
            "nixl_shm_interleaved_ms": k.get("nixl_shm_interleaved_ms"),
            "ratio_kvd_nixl_shm": round(k["kvd_gbps"] / stream, 3),
            "ratio_kvd_nixl_shm_separate": round(k["kvd_gbps"] / separate, 3),
            "kvd_gbps_daemon": k["kvd_daemon_gbps"],
            # What posting cost, from the decode daemon's /metrics over the timed pulls.
            "kvd_post_us_per_descriptor": k.get("kvd_post_us_per_descriptor"),
            "kvd_post_ms_per_pull": k.get("kvd_post_ms_per_pull"),
            "kvd_posting_share": k.get("kvd_posting_share"),
            "kvd_pool_page_bytes": k.get("kvd_pool_page_bytes"),
            "kvd_gbps_consecutive": k["kvd_gbps_consecutive"],
            # Consecutive block ids (one merged descriptor per rank pair, cut by bytes over
            # the posting workers) against the raw stream timed between those pulls.
            "nixl_gbps_shm_interleaved_consecutive": k.get(
                "nixl_gbps_shm_interleaved_consecutive"),
            "ratio_kvd_nixl_shm_consecutive": round(
                k["kvd_gbps_consecutive"]
                / (k.get("nixl_gbps_shm_interleaved_consecutive") or separate), 3),
            "kvd_ms_consecutive": k.get("kvd_ms_consecutive"),
            "nixl_shm_interleaved_ms_consecutive": k.get("nixl_shm_interleaved_ms_consecutive"),
            "verified_consecutive": k.get("verified_consecutive"),
            "descriptors_consecutive": ndesc[scn.name + ":consecutive"],
            "memcpy_gbps_best": memcpy["memcpy_gbps_best"],
            # Same copy between two pools allocated like kvd's (pool_backing auto: 2 MiB
            # pages where the host has them, else 4 KiB shm): the memory kind kvd
            # actually moves, for a like-for-like ceiling; raw NIXL's "_shm" sets too.
            "memcpy_gbps_shm": memcpy["memcpy_gbps_shm"],
            "shm_buffers_backing": memcpy.get("shm_buffers_backing"),
            "shm_buffers_page_nbytes": memcpy.get("shm_buffers_page_nbytes"),
            "ratio_kvd_memcpy_shm": round(k["kvd_gbps"] / memcpy["memcpy_gbps_shm"], 3),
            "kvd_ms": k["kvd_ms"],
            "nixl_ms": [fmt_ms(x) for x in nixl["single"]],
            "nixl_ms_kvd_descriptors": [fmt_ms(x) for x in nixl[scn.name]],
            "kvd_warmup_ms": k["warmup_ms"],
            "verified": k["verified"],
        })
    lat = kvd.get("latency", {})
    result: dict[str, Any] = {
        "scenarios": out_scn,
        "pull_1block_p50_ms": lat.get("pull_1block_p50_ms"),
        "pull_1block_p99_ms": lat.get("pull_1block_p99_ms"),
        "pull_1block_with_publish_p50_ms": lat.get("pull_1block_with_publish_p50_ms"),
        "pull_1block_daemon_p50_ms": lat.get("pull_1block_daemon_p50_ms"),
        "pull_1block_daemon_p99_ms": lat.get("pull_1block_daemon_p99_ms"),
        "pull_1block_nbytes": lat.get("pull_1block_nbytes"),
        "pull_1block_samples": lat.get("pull_1block_samples"),
        # kvd.tools.bench.floor: the same messages and READ without kvd's work. The
        # ratio is what kvd's control path costs; a target below the floor is out of
        # reach on this machine for any design with those two round trips.
        "floor_1block_p50_ms": lat.get("floor_1block_p50_ms"),
        "floor_1block_p99_ms": lat.get("floor_1block_p99_ms"),
        "floor_verified": lat.get("floor_verified"),
        # the floor's pulls alternate with kvd's (the same background load)
        "floor_1block_samples": lat.get("floor_1block_samples"),
        "floor_interleaved": "floor_1block_samples" in lat,
        "ratio_pull_1block_floor": (
            round(lat["pull_1block_p50_ms"] / lat["floor_1block_p50_ms"], 2)
            if lat.get("floor_1block_p50_ms") else None),
        "ratio_pull_1block_floor_p99": (
            round(lat["pull_1block_p99_ms"] / lat["floor_1block_p99_ms"], 2)
            if lat.get("floor_1block_p99_ms") else None),
        # N concurrent 32 MiB pulls against one at a time, same run.
        **kvd.get("concurrency", {}),
        # READs and bytes per posting worker on the decode daemon over the whole run.
        "posting_worker_stats": kvd.get("rails", []),
        "geometry": geom.to_json(),
        "repeats": repeats,
        "targets": {"ratio_kvd_memcpy_min": TARGET_RATIO_KVD_MEMCPY,
                    "ratio_hetero_memcpy_min": TARGET_RATIO_HETERO_MEMCPY,
                    "ratio_kvd_nixl_min": TARGET_RATIO_KVD_NIXL,
                    "pull_1block_p50_ms_max": TARGET_P50_MS,
                    "pull_1block_p99_ms_max": TARGET_P99_MS,
                    "ratio_kvd_nixl_single_stream_min": TARGET_RATIO_SINGLE_STREAM,
                    "ratio_concurrent_vs_single_min": TARGET_RATIO_CONCURRENT,
                    "ratio_pull_1block_floor_p50_max": TARGET_FLOOR_P50,
                    "ratio_pull_1block_floor_p99_max": TARGET_FLOOR_P99},
        "machine": machine,
        "logs": str(logs),
        "seconds": round(time.perf_counter() - started, 1),
    }
    # Other processes on the box distort everything here (2 cores): say how busy it was.
    result["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    homog = out_scn[0]
    result["targets"]["met"] = {
        "ratio_kvd_memcpy": homog["ratio_kvd_memcpy"] >= TARGET_RATIO_KVD_MEMCPY,
        "ratio_kvd_nixl_shm": all(s["ratio_kvd_nixl_shm"] >= TARGET_RATIO_KVD_NIXL
                                  for s in out_scn),
        "ratio_hetero_memcpy": all(s["ratio_kvd_memcpy"] >= TARGET_RATIO_HETERO_MEMCPY
                                   for s in out_scn[1:]),
        "pull_1block_p50_ms": (result["pull_1block_p50_ms"] is not None
                               and result["pull_1block_p50_ms"] <= TARGET_P50_MS),
        "pull_1block_p99_ms": (result["pull_1block_p99_ms"] is not None
                               and result["pull_1block_p99_ms"] <= TARGET_P99_MS),
        # (ratio_kvd_nixl_shm: kvd / one descriptor, one posting thread, same
        # memory kind: the best single stream)
        "ratio_kvd_nixl_single_stream": all(s["ratio_kvd_nixl_shm"] >= TARGET_RATIO_SINGLE_STREAM
                                            for s in out_scn),
        # the same for consecutive block ids (contiguous pulls, split by bytes)
        "ratio_kvd_nixl_single_stream_contiguous": all(
            s["ratio_kvd_nixl_shm_consecutive"] >= TARGET_RATIO_SINGLE_STREAM for s in out_scn),
        "ratio_concurrent_vs_single": (result.get("ratio_concurrent_vs_single") is not None
                                       and result["ratio_concurrent_vs_single"]
                                       >= TARGET_RATIO_CONCURRENT),
        "ratio_pull_1block_floor_p50": (result["ratio_pull_1block_floor"] is not None
                                        and result["ratio_pull_1block_floor"]
                                        <= TARGET_FLOOR_P50),
        "ratio_pull_1block_floor_p99": (result["ratio_pull_1block_floor_p99"] is not None
                                        and result["ratio_pull_1block_floor_p99"]
                                        <= TARGET_FLOOR_P99),
    }
    return result


def render(result: dict[str, Any]) -> str:
    cols = [("scenario", "name", "{}"), ("MiB", "nbytes", "{:.0f}"),
            ("memcpy", "memcpy_gbps", "{:.2f}"), ("memcpy shm", "memcpy_gbps_shm", "{:.2f}"),
            ("nixl", "nixl_gbps", "{:.2f}"),
            ("nixl shm", "nixl_gbps_shm", "{:.2f}"),
            ("nixl shm alt.", "nixl_gbps_shm_interleaved", "{:.2f}"),
            ("nixl kvd-descs", "nixl_gbps_kvd_descriptors", "{:.2f}"),
            ("nixl kvd-descs shm", "nixl_gbps_kvd_descriptors_shm", "{:.2f}"),
            ("kvd", "kvd_gbps", "{:.2f}"), ("kvd/memcpy", "ratio_kvd_memcpy", "{:.2f}"),
            ("kvd/nixl shm", "ratio_kvd_nixl_shm", "{:.2f}"),
            ("kvd consec.", "kvd_gbps_consecutive", "{:.2f}"),
            ("consec./nixl shm", "ratio_kvd_nixl_shm_consecutive", "{:.2f}"),
            ("descs", "descriptors", "{}")]
    rows = [[c[0] for c in cols]]
    for s in result["scenarios"]:
        row = []
        for _, key, fmt in cols:
            v = s[key] / MiB if key == "nbytes" else s[key]
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    m = result["machine"]
    g = result["geometry"]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        "",
        "GB/s, medians of "
        f"{result['repeats']}. nixl: one descriptor; kvd-descs: the descriptors kvd posts; "
        f"shm: on {m.get('shm_dir', DEFAULT_SHM_DIR)} pools like kvd's (else numpy heap "
        "memory, huge pages)",
        "kvd: publish -> pull -> done_recving at the client, random block ids "
        "(consec.: consecutive ids, kvd's best case)",
        "nixl shm alt.: that one-descriptor READ again, alternating with kvd's repeats (same "
        "background load); kvd/nixl shm divides by it",
        f"1-block pull ({(result['pull_1block_nbytes'] or 0) / MiB:.1f} MiB): "
        f"p50 {result['pull_1block_p50_ms']} ms, p99 {result['pull_1block_p99_ms']} ms "
        f"over {result['pull_1block_samples']} pulls; the floor (the same messages and "
        f"READ, no kvd: benchmarks/README.md; its pulls alternate with kvd's) p50 "
        f"{result.get('floor_1block_p50_ms')} ms, "
        f"p99 {result.get('floor_1block_p99_ms')} ms; kvd/floor "
        f"{result.get('ratio_pull_1block_floor')}",
        f"geometry: {g['layers']} layers, {g['kv_heads']} KV heads, head_dim {g['head_dim']}, "
        f"{g['dtype']}, {g['block_size_tokens']}-token blocks ({g['token_nbytes'] // 1024} "
        f"KiB/token), kv_layout {g['kv_layout']} {g['head_layout']}",
        f"machine: {m.get('cores')} cores, {m.get('mem_gib')} GiB, {m.get('cpu', '?')}, "
        f"nixl {m.get('nixl')}; shm_dir {m.get('shm_dir')} ({m.get('shm_mount')}); pools: "
        f"{result['scenarios'][0].get('shm_buffers_backing')}, "
        f"{(result['scenarios'][0].get('kvd_pool_page_bytes') or 0) // 1024} KiB pages",
        f"posting workers: {m.get('posting_workers_used')} ({m.get('posting_workers')}); "
        f"{result.get('concurrent_pulls')} concurrent "
        f"{(result.get('concurrent_pull_nbytes') or 0) // MiB} MiB pulls "
        f"{result.get('concurrent_gbps')} GB/s vs one {result.get('single_pull_gbps')}: "
        f"x{result.get('ratio_concurrent_vs_single')}; 1-block kvd/floor p50 "
        f"x{result.get('ratio_pull_1block_floor')}, p99 "
        f"x{result.get('ratio_pull_1block_floor_p99')}",
        "targets: " + "; ".join(
            f"{label}: {'met' if result['targets']['met'][key] else 'MISSED'}"
            for label, key in (
                (f"homogeneous >= {TARGET_RATIO_KVD_MEMCPY}x memcpy", "ratio_kvd_memcpy"),
                (f"hetero >= {TARGET_RATIO_HETERO_MEMCPY}x memcpy", "ratio_hetero_memcpy"),
                (f"kvd >= {TARGET_RATIO_KVD_NIXL}x nixl shm", "ratio_kvd_nixl_shm"),
                (f"1-block p50 <= {TARGET_P50_MS} ms", "pull_1block_p50_ms"),
                (f"p99 <= {TARGET_P99_MS} ms", "pull_1block_p99_ms"),
                (f"each >= {TARGET_RATIO_SINGLE_STREAM}x one nixl stream",
                 "ratio_kvd_nixl_single_stream"),
                (f"contiguous >= {TARGET_RATIO_SINGLE_STREAM}x one nixl stream",
                 "ratio_kvd_nixl_single_stream_contiguous"),
                (f"concurrent >= {TARGET_RATIO_CONCURRENT}x one pull",
                 "ratio_concurrent_vs_single"),
                (f"1-block p50 <= {TARGET_FLOOR_P50}x floor", "ratio_pull_1block_floor_p50"),
                (f"p99 <= {TARGET_FLOOR_P99}x floor", "ratio_pull_1block_floor_p99"))),
        f"({result['seconds']} s; daemon logs in {result['logs']})",
    ]
    return "\n".join(lines)
