"""`kvd bench`: memcpy vs raw NIXL vs kvd end to end, same machine, same bytes.

One run measures, in this order (so that buffers of one phase are freed before
the next one allocates; peak is ~2 GiB at the default 512 MiB):

1. memcpy: one numpy copy of ``nbytes`` between two preallocated, pre-faulted
   buffers (median and best of several). The single-core ceiling.
2. raw NIXL READ: two agents in two spawned processes, DRAM, progress thread
   off, buffers pre-faulted; the target polls ``get_new_notifs`` continuously.
   Each descriptor set is warmed once (connection setup, page faults), then
   timed from building the transfer to DONE (median). Sets: one big descriptor
   (the best NIXL can do) and exactly the descriptors kvd builds for each
   scenario (kvd's own ceiling).
3. kvd: two ``kvd serve`` processes (prefill node, decode node), simulated
   engines registered with ``KvdClient``, a request of ``nbytes`` published on
   the prefill side and pulled by the decode side; timed at the client from
   ``publish`` to the ``done_recving`` event (median of fresh request ids
   reusing the same blocks, after one warm-up pull that does the handshake and
   faults pages). Block ids are a random sample of a pool 1.25x the request
   (realistic, fragmented cache); consecutive ids (kvd's best case: the
   descriptors merge) are measured too and reported as ``kvd_gbps_consecutive``.
   Data are checked byte for byte after the warm-up and once more at the end.
4. 1-block pull latency: many sequential pulls of a 1-block request (pull
   call to ``done_recving`` at the client), p50/p99.

Geometry: a Llama-3-8B-like cache (32 layers, 8 KV heads, head_dim 128,
bf16, 16-token blocks, HND; ``kv_layout`` kv_split by default, or any of
``KV_LAYOUTS``, the same on both engines) = 128 KiB per token, 2 MiB per
block; 512 MiB is a 4096-token request. With kv_split a random-block request
is 16,384 descriptors of 32 KiB; with cross_layer it is 256 descriptors of
2 MiB (one per block).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvd.protocol import ModelSpec
from kvd.sim import EngineShape, _blocks_view, layout_spec

MiB = 1 << 20
TARGET_RATIO_KVD_MEMCPY = 0.7
TARGET_P50_MS = 2.0


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size_tokens: int = 16
    kv_layout: str = "kv_split"
    head_layout: str = "HND"

    def model(self) -> ModelSpec:
        return ModelSpec(name="bench-model", num_kv_heads=self.kv_heads, num_layers=self.layers,
                         head_dim=self.head_dim, dtype=self.dtype, mla=False)

    @property
    def token_nbytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2

    @property
    def block_nbytes(self) -> int:
        return self.token_nbytes * self.block_size_tokens

    def shape(self, tp: int, num_blocks: int) -> EngineShape:
        return EngineShape(tp, 1, self.block_size_tokens, num_blocks=num_blocks,
                           kv_layout=self.kv_layout, head_layout=self.head_layout)

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "block_size_tokens": self.block_size_tokens,
                "kv_layout": self.kv_layout, "head_layout": self.head_layout,
                "token_nbytes": self.token_nbytes, "block_nbytes": self.block_nbytes}


@dataclass(frozen=True)
class Scenario:
    name: str
    prefill_tp: int
    decode_tp: int


HOMOGENEOUS = Scenario("homogeneous", 1, 1)
HETERO = Scenario("hetero", 1, 2)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(np.ceil(q / 100 * len(s))) - 1))
    return s[k]


# ------------------------------------------------------------------ machine


def machine_info() -> dict[str, Any]:
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
    info["loadavg_1m_start"] = round(os.getloadavg()[0], 2)
    return info


# ------------------------------------------------------------------ memcpy


def _copy_times(src: np.ndarray, dst: np.ndarray, repeats: int) -> list[float]:
    src.fill(1)  # pre-fault both buffers
    dst.fill(0)
    np.copyto(dst, src)  # warm
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return times


def bench_memcpy(nbytes: int, repeats: int) -> dict[str, float]:
    """Heap-to-heap (numpy asks for huge pages) and shm-to-shm (the pools kvd uses)."""
    times = _copy_times(np.empty(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8),
                        repeats)
    (src, src_pool), (dst, dst_pool) = _alloc("shm", nbytes), _alloc("shm", nbytes)
    shm_times = _copy_times(src, dst, repeats)
    del src, dst
    src_pool.close()
    dst_pool.close()
    return {"memcpy_gbps": _gbps(nbytes, statistics.median(times)),
            "memcpy_gbps_best": _gbps(nbytes, min(times)),
            "memcpy_gbps_shm": _gbps(nbytes, statistics.median(shm_times))}


# ------------------------------------------------------------------ descriptors


def kvd_descriptors(geom: Geometry, scn: Scenario, p_blocks: int, d_blocks: int,
                    p_ids: list[int], d_ids: list[int]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The descriptors kvd builds for one pull, as offsets into the concatenated pools.

    Returns (local offsets, remote offsets, sizes, local bytes, remote bytes): local
    offsets index the decode ranks' pools laid end to end, remote ones the prefill's.
    """
    from kvd.daemon.engines import geometry, parallelism, rank_layout
    from kvd.planner import RankId, build_read_descriptors, plan_transfer
    from kvd.planner.blocks import match_blocks

    model = geom.model()
    lspec = layout_spec(geom.shape(scn.decode_tp, d_blocks))
    rspec = layout_spec(geom.shape(scn.prefill_tp, p_blocks))
    lpar, rpar = parallelism(scn.decode_tp, 1, None), parallelism(scn.prefill_tp, 1, None)
    plan = plan_transfer(geometry(model), rpar, lpar)
    lcache, lfirst = rank_layout(model, lspec, lpar, 0)
    rcache, rfirst = rank_layout(model, rspec, rpar, 0)
    local_ids, remote_ids = match_blocks(d_ids, p_ids, geom.block_size_tokens,
                                         geom.block_size_tokens)
    lo, ro, nb = [], [], []
    for t in range(scn.decode_tp):
        for read in plan.reads_for(RankId(t, 0)):
            d = build_read_descriptors(read, lcache, lfirst, rcache, rfirst, local_ids, remote_ids)
            lo.append(d.local_offsets + t * lcache.total_nbytes)
            ro.append(d.remote_offsets + read.remote.tp_rank * rcache.total_nbytes)
            nb.append(d.nbytes)
    return (np.concatenate(lo), np.concatenate(ro), np.concatenate(nb),
            scn.decode_tp * lcache.total_nbytes, scn.prefill_tp * rcache.total_nbytes)


# ------------------------------------------------------------------ raw NIXL


def _fill_pattern(buf: np.ndarray) -> None:
    """Unique 8-byte words (offset / 8), written in chunks to avoid a big temporary."""
    words = buf.view(np.uint64)
    step = 1 << 20
    for i in range(0, words.size, step):
        n = min(step, words.size - i)
        words[i:i + n] = np.arange(i, i + n, dtype=np.uint64)


def _check_pattern(buf: np.ndarray) -> bool:
    words = buf.view(np.uint64)
    step = 1 << 20
    for i in range(0, words.size, step):
        n = min(step, words.size - i)
        if not np.array_equal(words[i:i + n], np.arange(i, i + n, dtype=np.uint64)):
            return False
    return True


def _new_agent(name: str) -> Any:
    import logging

    from kvd.transport.nixl import import_nixl

    api = import_nixl()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                      backends=["UCX"]))


MEMORY_KINDS = ("anon", "shm")


def _alloc(kind: str, nbytes: int) -> tuple[np.ndarray, Any]:
    """anon: numpy heap memory (numpy asks for transparent huge pages on big arrays);
    shm: a POSIX shared-memory pool exactly like the ones kvd allocates (4 KiB pages
    unless /dev/shm is mounted with huge pages). Unlinked at once: nothing can leak."""
    if kind == "anon":
        return np.empty(nbytes, dtype=np.uint8), None
    from kvd.pool import SHM_DIR, ShmPool

    pool = ShmPool.create("kvd-bench", nbytes)
    os.unlink(SHM_DIR / pool.name)
    return pool.array, pool


def _nixl_target(conn: Any, stop: Any, nbytes: int) -> None:
    """Spawned: owns the source buffers and polls notifications until told to stop."""
    agent = _new_agent(f"bench-target-{os.getpid()}")
    bases, keep = {}, []
    for kind in MEMORY_KINDS:
        buf, owner = _alloc(kind, nbytes)
        _fill_pattern(buf)  # also pre-faults
        agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
        bases[kind] = int(buf.ctypes.data)
        keep.append((buf, owner))
    conn.send((bytes(agent.get_agent_metadata()), bases))
    notifs = 0
    while not stop.is_set():
        for _ in range(256):
            for msgs in agent.get_new_notifs().values():
                notifs += len(msgs)
    conn.send(notifs)


def _nixl_initiator(conn: Any, meta: bytes, remote_bases: dict[str, int], nbytes: int,
                    sets: list[tuple[str, str, np.ndarray, np.ndarray, np.ndarray]],
                    repeats: int, check_set: str) -> None:
    """Spawned: READs each descriptor set (1 warm-up + repeats) and reports seconds.

    A set is (name, memory kind, local offsets, remote offsets, sizes); timed from
    building the transfer (descriptors, initialize_xfer) to DONE, like kvd's post.
    """
    agent = _new_agent(f"bench-initiator-{os.getpid()}")
    bufs, keep = {}, []
    for kind in MEMORY_KINDS:
        buf, owner = _alloc(kind, nbytes)
        buf.fill(0xFF)  # pre-fault
        agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
        bufs[kind] = buf
        keep.append(owner)
    peer = agent.add_remote_agent(meta)
    out: dict[str, Any] = {}
    for name, kind, lo, ro, nb in sets:
        n = len(nb)
        buf = bufs[kind]
        buf.fill(0xFF)
        local = np.empty((n, 3), dtype=np.uint64)
        remote = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = lo + int(buf.ctypes.data), nb, 0
        remote[:, 0], remote[:, 1], remote[:, 2] = ro + remote_bases[kind], nb, 0
        totals, posts = [], []
        for i in range(1 + repeats):
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), peer, b"bench")
            state = agent.transfer(handle)
            t1 = time.perf_counter()
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError(f"raw NIXL READ {name} failed")
                state = agent.check_xfer_state(handle)
            t2 = time.perf_counter()
            agent.release_xfer_handle(handle)
            if i == 0:
                out[name + ":first_s"] = t2 - t0
            else:
                totals.append(t2 - t0)
                posts.append(t1 - t0)
        out[name] = totals
        out[name + ":post"] = posts
        if name == check_set:
            out["verified"] = _check_pattern(buf[: int(nb.sum())])
    conn.send(out)


def bench_nixl(local_nbytes: int, remote_nbytes: int,
               sets: list[tuple[str, str, np.ndarray, np.ndarray, np.ndarray]], repeats: int,
               check_set: str, timeout_s: float = 120.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    stop = ctx.Event()
    target = ctx.Process(target=_nixl_target, args=(t_child, stop, remote_nbytes), daemon=True)
    target.start()
    initiator = None
    try:
        if not t_parent.poll(timeout_s):
            raise RuntimeError("NIXL target process did not start")
        meta, remote_bases = t_parent.recv()
        initiator = ctx.Process(target=_nixl_initiator, daemon=True,
                                args=(i_child, meta, remote_bases, local_nbytes, sets, repeats,
                                      check_set))
        initiator.start()
        if not i_parent.poll(timeout_s):
            raise RuntimeError("NIXL initiator did not report")
        res = i_parent.recv()
        stop.set()
        res["target_notifs"] = t_parent.recv() if t_parent.poll(10) else None
        return res
    finally:
        stop.set()
        for p in (initiator, target):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()


# ------------------------------------------------------------------ kvd


def _zero_blocks(kvs: list[np.ndarray], geom: Geometry, block_ids: list[int]) -> None:
    for kv in kvs:
        view = _blocks_view(kv, geom.kv_layout, geom.head_layout)
        for b in block_ids:
            view[b] = 0


def _check_blocks(pkv: np.ndarray, dkvs: list[np.ndarray], geom: Geometry, p_ids: list[int],
                  d_ids: list[int]) -> bool:
    """Decode rank t must hold heads [t*h, (t+1)*h) of the prefill blocks (any layout)."""
    pview = _blocks_view(pkv, geom.kv_layout, geom.head_layout)  # [block, L, kv, T, H, D]
    for t, dkv in enumerate(dkvs):
        dview = _blocks_view(dkv, geom.kv_layout, geom.head_layout)
        h = dview.shape[4]
        for i in range(0, len(p_ids), 64):  # a few blocks at a time: no 512 MiB temporaries
            want = pview[p_ids[i:i + 64]][:, :, :, :, t * h:(t + 1) * h]
            if not np.array_equal(dview[d_ids[i:i + 64]], want):
                return False
    return True


def _one_pull(pc: Any, dc: Any, prefill_addr: str, deng: str, rid: str, p_ids: list[int],
              d_ids: list[int]) -> tuple[float, float, Any]:
    """publish -> pull -> done_recving; returns (publish..done s, pull..done s, event)."""
    t0 = time.perf_counter()
    pc.publish("prefill", rid, p_ids)
    t1 = time.perf_counter()
    dc.pull(deng, rid, "prefill", prefill_addr, p_ids, d_ids)
    ev = dc.wait(deng, rid, "done_recving", timeout_s=60)
    t2 = time.perf_counter()
    if not ev.ok:
        raise RuntimeError(f"pull {rid} failed: {ev.error}")
    sent = pc.wait("prefill", rid, "done_sending", timeout_s=10)
    if not sent.ok:
        raise RuntimeError(f"producer did not release {rid}: {sent.error}")
    return t2 - t0, t2 - t1, ev


def bench_kvd(geom: Geometry, scenarios: list[Scenario], blocks: int, pool_blocks: int,
              p_ids: list[int], d_ids: list[int], repeats: int, latency_pulls: int,
              log_dir: Path) -> dict[str, Any]:
    from kvd.localcluster import DaemonProcess

    model = geom.model()
    out: dict[str, Any] = {"scenarios": {}}
    prefill = DaemonProcess.start("bench-prefill", log_dir)
    decode = DaemonProcess.start("bench-decode", log_dir)
    pc, dc = prefill.client(timeout_s=30), decode.client(timeout_s=30)
    try:
        pshape = geom.shape(1, pool_blocks)
        prank = pc.register("prefill", model, layout_spec(pshape), 0, 1)
        _fill_pattern(prank.kv.reshape(-1).view(np.uint8))
        consecutive = list(range(blocks))
        for scn in scenarios:
            deng = f"decode-tp{scn.decode_tp}"
            dshape = geom.shape(scn.decode_tp, pool_blocks)
            dranks = [dc.register(deng, model, layout_spec(dshape), t, scn.decode_tp)
                      for t in range(scn.decode_tp)]
            dkvs = [r.kv for r in dranks]
            r: dict[str, Any] = {}
            # Warm-up: handshake, NIXL connection, page faults on both sides.
            t, _, ev = _one_pull(pc, dc, prefill.peer_address, deng, f"{deng}-warm", p_ids,
                                 d_ids)
            r["warmup_ms"] = _ms(t)
            r["verified_warmup"] = _check_blocks(prank.kv, dkvs, geom, p_ids, d_ids)
            totals, daemon = [], []
            for i in range(repeats):
                t, _, ev = _one_pull(pc, dc, prefill.peer_address, deng, f"{deng}-{i}", p_ids,
                                     d_ids)
                totals.append(t)
                daemon.append(ev.duration_s)
            r["nbytes"] = ev.nbytes
            r["kvd_ms"] = [_ms(x) for x in totals]
            r["kvd_gbps"] = _gbps(ev.nbytes, statistics.median(totals))
            r["kvd_daemon_gbps"] = _gbps(ev.nbytes, statistics.median(daemon))
            # Consecutive blocks on both sides: kvd's best case (descriptors merge).
            _one_pull(pc, dc, prefill.peer_address, deng, f"{deng}-cwarm", consecutive,
                      consecutive)
            ctimes = [_one_pull(pc, dc, prefill.peer_address, deng, f"{deng}-c{i}",
                                consecutive, consecutive)[0] for i in range(repeats)]
            r["kvd_gbps_consecutive"] = _gbps(ev.nbytes, statistics.median(ctimes))
            # Final check: zero the destination, pull once more, compare.
            _zero_blocks(dkvs, geom, d_ids)
            _one_pull(pc, dc, prefill.peer_address, deng, f"{deng}-check", p_ids, d_ids)
            r["verified"] = r["verified_warmup"] and _check_blocks(prank.kv, dkvs, geom, p_ids,
                                                                   d_ids)
            out["scenarios"][scn.name] = r
            if scn.decode_tp == 1 and latency_pulls > 0:
                out["latency"] = _latency(pc, dc, prefill.peer_address, deng, p_ids[:1],
                                          d_ids[:1], latency_pulls)
            for h in dranks:
                dc.deregister(h)
        return out
    finally:
        pc.close()
        dc.close()
        prefill.stop()
        decode.stop()


def _latency(pc: Any, dc: Any, prefill_addr: str, deng: str, p_ids: list[int],
             d_ids: list[int], pulls: int) -> dict[str, Any]:
    for i in range(max(10, pulls // 10)):
        _one_pull(pc, dc, prefill_addr, deng, f"lat-warm-{i}", p_ids, d_ids)
    pull_s, total_s = [], []
    for i in range(pulls):
        total, pull, ev = _one_pull(pc, dc, prefill_addr, deng, f"lat-{i}", p_ids, d_ids)
        pull_s.append(pull)
        total_s.append(total)
    return {"pull_1block_p50_ms": _ms(_pct(pull_s, 50)),
            "pull_1block_p99_ms": _ms(_pct(pull_s, 99)),
            "pull_1block_with_publish_p50_ms": _ms(_pct(total_s, 50)),
            "pull_1block_nbytes": ev.nbytes, "pull_1block_samples": pulls}


# ------------------------------------------------------------------ driver


def run_bench(nbytes_mib: int = 512, repeats: int = 5, skip_hetero: bool = False,
              latency_pulls: int = 200, seed: int = 7,
              kv_layout: str = "kv_split") -> dict[str, Any]:
    started = time.perf_counter()
    machine = machine_info()
    geom = Geometry(kv_layout=kv_layout)
    blocks = max(1, nbytes_mib * MiB // geom.block_nbytes)
    nbytes = blocks * geom.block_nbytes
    pool_blocks = blocks + max(1, blocks // 4)
    rng = random.Random(seed)
    p_ids = rng.sample(range(pool_blocks), blocks)
    d_ids = rng.sample(range(pool_blocks), blocks)
    scenarios = [HOMOGENEOUS] if skip_hetero else [HOMOGENEOUS, HETERO]

    memcpy = bench_memcpy(nbytes, repeats)

    sets: list[tuple[str, str, np.ndarray, np.ndarray, np.ndarray]] = []
    one = np.array([0], dtype=np.int64)
    whole = np.array([nbytes], dtype=np.int64)
    sets.append(("single", "anon", one, one.copy(), whole))
    sets.append(("single:shm", "shm", one, one.copy(), whole))
    ndesc: dict[str, int] = {}
    desc_nbytes: dict[str, int] = {}
    local_max = remote_max = nbytes
    for scn in scenarios:
        lo, ro, nb, lbytes, rbytes = kvd_descriptors(geom, scn, pool_blocks, pool_blocks,
                                                     p_ids, d_ids)
        assert int(nb.sum()) == nbytes, (scn, int(nb.sum()), nbytes)
        sets.append((scn.name, "anon", lo, ro, nb))
        sets.append((scn.name + ":shm", "shm", lo, ro, nb))
        ndesc[scn.name] = len(nb)
        desc_nbytes[scn.name] = int(np.median(nb))
        local_max, remote_max = max(local_max, lbytes), max(remote_max, rbytes)
        _, _, cnb, _, _ = kvd_descriptors(geom, scn, pool_blocks, pool_blocks,
                                          list(range(blocks)), list(range(blocks)))
        ndesc[scn.name + ":consecutive"] = len(cnb)
    nixl = bench_nixl(local_max, remote_max, sets, repeats, check_set="single")
    if not nixl.get("verified"):
        raise RuntimeError("raw NIXL READ did not deliver the expected bytes")
    nixl_best = _gbps(nbytes, statistics.median(nixl["single"]))

    logs = Path(tempfile.mkdtemp(prefix="kvd-bench-"))
    kvd = bench_kvd(geom, scenarios, blocks, pool_blocks, p_ids, d_ids, repeats, latency_pulls,
                    logs)

    out_scn = []
    for scn in scenarios:
        k = kvd["scenarios"][scn.name]
        same = statistics.median(nixl[scn.name])
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
            "nixl_gbps_shm": _gbps(nbytes, statistics.median(nixl["single:shm"])),
            "nixl_gbps_kvd_descriptors": _gbps(nbytes, same),
            "nixl_gbps_kvd_descriptors_shm": _gbps(
                nbytes, statistics.median(nixl[scn.name + ":shm"])),
            "nixl_post_ms_kvd_descriptors": _ms(statistics.median(nixl[scn.name + ":post"])),
            # kvd against raw NIXL moving the same descriptors on the same kind of memory:
            # what kvd itself costs (the rest is NIXL/UCX and 4 KiB shm pages).
            "ratio_kvd_nixl_same_descriptors_shm": round(
                k["kvd_gbps"] / _gbps(nbytes, statistics.median(nixl[scn.name + ":shm"])), 3),
            "kvd_gbps_daemon": k["kvd_daemon_gbps"],
            "kvd_gbps_consecutive": k["kvd_gbps_consecutive"],
            "descriptors_consecutive": ndesc[scn.name + ":consecutive"],
            "memcpy_gbps_best": memcpy["memcpy_gbps_best"],
            # Same copy between two shm pools (4 KiB pages, like kvd's): the memory kind
            # kvd actually moves, for a like-for-like ceiling.
            "memcpy_gbps_shm": memcpy["memcpy_gbps_shm"],
            "ratio_kvd_memcpy_shm": round(k["kvd_gbps"] / memcpy["memcpy_gbps_shm"], 3),
            "kvd_ms": k["kvd_ms"],
            "nixl_ms": [_ms(x) for x in nixl["single"]],
            "nixl_ms_kvd_descriptors": [_ms(x) for x in nixl[scn.name]],
            "kvd_warmup_ms": k["warmup_ms"],
            "verified": k["verified"],
        })
    lat = kvd.get("latency", {})
    result: dict[str, Any] = {
        "scenarios": out_scn,
        "pull_1block_p50_ms": lat.get("pull_1block_p50_ms"),
        "pull_1block_p99_ms": lat.get("pull_1block_p99_ms"),
        "pull_1block_with_publish_p50_ms": lat.get("pull_1block_with_publish_p50_ms"),
        "pull_1block_nbytes": lat.get("pull_1block_nbytes"),
        "pull_1block_samples": lat.get("pull_1block_samples"),
        "geometry": geom.to_json(),
        "repeats": repeats,
        "targets": {"ratio_kvd_memcpy_min": TARGET_RATIO_KVD_MEMCPY,
                    "pull_1block_p50_ms_max": TARGET_P50_MS},
        "machine": machine,
        "logs": str(logs),
        "seconds": round(time.perf_counter() - started, 1),
    }
    # Other processes on the box distort everything here (2 cores): say how busy it was.
    result["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    homog = out_scn[0]
    result["targets"]["met"] = {
        "ratio_kvd_memcpy": homog["ratio_kvd_memcpy"] >= TARGET_RATIO_KVD_MEMCPY,
        "pull_1block_p50_ms": (result["pull_1block_p50_ms"] is not None
                               and result["pull_1block_p50_ms"] <= TARGET_P50_MS),
    }
    return result


def render(result: dict[str, Any]) -> str:
    cols = [("scenario", "name", "{}"), ("MiB", "nbytes", "{:.0f}"),
            ("memcpy", "memcpy_gbps", "{:.2f}"), ("memcpy shm", "memcpy_gbps_shm", "{:.2f}"),
            ("nixl", "nixl_gbps", "{:.2f}"),
            ("nixl shm", "nixl_gbps_shm", "{:.2f}"),
            ("nixl kvd-descs", "nixl_gbps_kvd_descriptors", "{:.2f}"),
            ("nixl kvd-descs shm", "nixl_gbps_kvd_descriptors_shm", "{:.2f}"),
            ("kvd", "kvd_gbps", "{:.2f}"), ("kvd/memcpy", "ratio_kvd_memcpy", "{:.2f}"),
            ("kvd consec.", "kvd_gbps_consecutive", "{:.2f}"), ("descs", "descriptors", "{}")]
    rows = [[c[0] for c in cols]]
    for s in result["scenarios"]:
        row = []
        for _, key, fmt in cols:
            v = s[key] / MiB if key == "nbytes" else s[key]
            row.append(fmt.format(v))
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
        "shm: on /dev/shm pools like kvd's (else numpy heap memory, huge pages)",
        "kvd: publish -> pull -> done_recving at the client, random block ids "
        "(consec.: consecutive ids, kvd's best case)",
        f"1-block pull ({(result['pull_1block_nbytes'] or 0) / MiB:.1f} MiB): "
        f"p50 {result['pull_1block_p50_ms']} ms, p99 {result['pull_1block_p99_ms']} ms "
        f"over {result['pull_1block_samples']} pulls",
        f"geometry: {g['layers']} layers, {g['kv_heads']} KV heads, head_dim {g['head_dim']}, "
        f"{g['dtype']}, {g['block_size_tokens']}-token blocks ({g['token_nbytes'] // 1024} "
        f"KiB/token), kv_layout {g['kv_layout']} {g['head_layout']}",
        f"machine: {m.get('cores')} cores, {m.get('mem_gib')} GiB, {m.get('cpu', '?')}, "
        f"nixl {m.get('nixl')}",
        f"targets: kvd >= {TARGET_RATIO_KVD_MEMCPY}x memcpy: "
        f"{'met' if result['targets']['met']['ratio_kvd_memcpy'] else 'MISSED'}; "
        f"1-block p50 <= {TARGET_P50_MS} ms: "
        f"{'met' if result['targets']['met']['pull_1block_p50_ms'] else 'MISSED'}",
        f"({result['seconds']} s; daemon logs in {result['logs']})",
    ]
    return "\n".join(lines)


def main(as_json: bool = False, nbytes_mib: int = 512, repeats: int = 5,
         skip_hetero: bool = False, kv_layout: str = "kv_split") -> int:
    result = run_bench(nbytes_mib=nbytes_mib, repeats=repeats, skip_hetero=skip_hetero,
                       kv_layout=kv_layout)
    print(json.dumps(result, indent=2) if as_json else render(result))
    return 0 if all(s["verified"] for s in result["scenarios"]) else 1
