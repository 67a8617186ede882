"""VRAM -> VRAM: kvd with CUDA IPC pools next to raw NIXL on GPU buffers, one GPU, one run.

``device="cuda"`` runs it on a GPU node (run on an H200: benchmarks/README.md);
``device="cpu"`` runs the very same code on DRAM (heap buffers for raw NIXL, shm pools
for kvd), which checks its plumbing on a machine without a GPU.

Phases (each frees its buffers before the next):

1. copy ceiling: ``torch`` device-to-device copy of ``nbytes`` (cudaMemcpy D2D) on the
   GPU, or a memcpy on CPU;
2. raw NIXL READ between two spawned processes, each owning a ``nbytes x 1.25`` buffer
   on GPU ``gpu`` (``torch.empty(..., device="cuda:N")``, registered as VRAM): one
   descriptor (the ceiling); exactly the descriptors kvd posts for the pull (a fresh
   list, as the daemon posts today); the same through ``PreppedPoster`` (prepared
   lists). The target fills its buffer with random bytes on the GPU; the initiator
   compares on the GPU;
3. kvd: two ``kvd serve --device cuda`` daemons (prefill, decode) on the same GPU;
   engines register through ``KvdClient`` and open their pools over CUDA IPC; the
   prefill pool is filled with random bytes on the GPU; pulls of random block ids timed
   at the client (publish -> done_recving, median after a warm-up), checked block by
   block against the prefill pool.

Needs on the GPU node: a CUDA build of torch (install without constraints-cpu.txt),
nixl-cu12 with UCX's CUDA transports, and the same GPU visible to both daemons.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.bench.geometry import DEFAULT_KV_LAYOUT
from kvd.tools.bench.raw import end_children

MiB = 1 << 20
# Targets for local pulls on one GPU: the local VRAM pull >= 0.8x a device copy of the
# same bytes, and the 1-block local pull p50 <= 0.5x the pull between two daemons.
TARGET_LOCAL_COPY = 0.8
TARGET_LOCAL_1BLOCK_RATIO = 0.5
TARGET_LOCAL_1BLOCK_P50_MS = 0.3  # and the 1-block local pull's p50 at most this


def _torch_device(device: str, gpu: int) -> Any:
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            from kvd.errors import KvdError

            raise KvdError("bench_vram --device cuda needs a CUDA GPU visible to torch "
                           "(torch.cuda.is_available() is False); --device cpu runs the same "
                           "code on DRAM")
        return torch.device(f"cuda:{gpu}")
    return torch.device("cpu")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _random_fill(t: Any, seed: int) -> None:
    """Random bytes on the tensor's own device (no host round trip on a GPU)."""
    import torch

    g = torch.Generator(device=t.device)
    g.manual_seed(seed)
    flat = t.view(-1).view(torch.int16)
    step = 64 * MiB
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        flat[i:i + n] = torch.randint(-32768, 32767, (n,), dtype=torch.int16, device=t.device,
                                      generator=g)


def copy_ceiling(nbytes: int, device: str, gpu: int, repeats: int) -> float:
    import torch

    dev = _torch_device(device, gpu)
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return round(nbytes / statistics.median(times) / 1e9, 2)


def copier_on_descriptors(pool_nbytes: int, desc: tuple[np.ndarray, np.ndarray, np.ndarray],
                          gpu: int, repeats: int) -> dict[str, Any]:
    """The daemon's CUDA copier alone (kvd.transport.copies.cudacopy, as a local pull uses it)
    on exactly kvd's descriptors between two GPU buffers: post -> completion observed,
    median; and the bytes checked once against a gather done by torch."""
    import torch

    from kvd.transport.copies.cudacopy import CudaCopier

    lo, ro, nb = desc
    src = torch.empty(pool_nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
    _random_fill(src, 5)
    dst = torch.zeros_like(src)
    c = CudaCopier()
    try:
        c.wait_kernels(120)  # compiled on a thread: the timed copies take the kernel
        times = []
        for i in range(1 + max(3, repeats)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = c.post(lo + dst.data_ptr(), ro + src.data_ptr(), nb, dst_devs=gpu,
                       src_devs=gpu)
            while not c.poll(h):
                pass
            if i:
                times.append(time.perf_counter() - t0)
            c.release(h)
        ok = all(torch.equal(dst[a:a + n], src[b:b + n])
                 for a, b, n in zip(lo.tolist()[:4096], ro.tolist()[:4096],
                                    nb.tolist()[:4096], strict=True))
        nbytes = int(nb.sum())
        return {"gbps": round(nbytes / statistics.median(times) / 1e9, 2),
                "ms": round(statistics.median(times) * 1e3, 3), "verified_first_4096": ok,
                "kernel": c.kernel and c.kernel_error is None, "kernel_error": c.kernel_error}
    finally:
        c.close()
        del src, dst
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ raw NIXL on GPU buffers


def _mem_type(device: str) -> str:
    return "VRAM" if device == "cuda" else "DRAM"


def _target(conn: Any, stop: Any, nbytes: int, device: str, gpu: int, seed: int) -> None:
    import torch

    from kvd.transport.remote.nixl import NixlTransport

    dev = _torch_device(device, gpu)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    _random_fill(buf, seed)
    _sync(device)
    t = NixlTransport(name=f"vram-target-{os.getpid()}")
    t.register(int(buf.data_ptr()), nbytes, _mem_type(device), gpu if device == "cuda" else 0)
    conn.send((t.metadata(), int(buf.data_ptr())))
    while not stop.is_set():
        for _ in range(256):
            t.notifications()
    t.close()
    del buf


def _initiator(conn: Any, meta: bytes, remote_base: int, nbytes: int, device: str, gpu: int,
               seed: int, sets: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]],
               repeats: int) -> None:
    import torch

    from kvd.transport.base import DescRows, PreppedRead, ReadPost
    from kvd.transport.remote.nixl import NixlTransport
    from kvd.transport.remote.prepped import PoolSpan, PreppedPoster

    dev = _torch_device(device, gpu)
    dev_id = gpu if device == "cuda" else 0
    mem = _mem_type(device)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    want = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    _random_fill(want, seed)  # the target's bytes, made the same way
    _sync(device)
    base = int(buf.data_ptr())
    t = NixlTransport(name=f"vram-init-{os.getpid()}")
    t.register(base, nbytes, mem, dev_id)
    peer = t.add_peer(meta)
    poster = PreppedPoster(t)
    pools = ((PoolSpan(base, nbytes, dev_id),), (PoolSpan(remote_base, nbytes, dev_id),))
    one_l = t.prepare_local(DescRows.grid(base, nbytes, 1, mem_type=mem, dev=dev_id))
    one_r = t.prepare_remote(peer, DescRows.grid(remote_base, nbytes, 1, mem_type=mem,
                                                 dev=dev_id))
    out: dict[str, Any] = {}

    def run(name: str, post: Any, check: tuple[np.ndarray, np.ndarray, np.ndarray] | None
            ) -> None:
        times = []
        for i in range(1 + repeats):
            if i == 1 and check is not None:
                lo, ro, nb = check
                ok = True
                for a, b, n in zip(lo.tolist(), ro.tolist(), nb.tolist(), strict=True):
                    if not torch.equal(buf[a:a + n], want[b:b + n]):
                        ok = False
                        break
                out[f"{name}:verified"] = ok
                buf.zero_()
                _sync(device)
            t0 = time.perf_counter()
            xfer, done = post()
            while not done:
                done = t.poll(xfer)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
            t.release(xfer)
        out[name] = times

    one = np.zeros(1, np.int32)
    run("single", lambda: t.post_prepped_read(PreppedRead(peer, one_l, one_r, one, one, b"v")),
        (np.array([0]), np.array([0]), np.array([nbytes])))
    for name, lo, ro, nb in sets:
        def read_post(lo: np.ndarray = lo, ro: np.ndarray = ro, nb: np.ndarray = nb) -> ReadPost:
            devs = np.full(len(nb), dev_id, dtype=np.int64)
            return ReadPost(peer=peer, local_addrs=base + lo, remote_addrs=remote_base + ro,
                            nbytes=nb, mem_type=mem, notif=b"v", local_devs=devs,
                            remote_devs=devs, local_pools=pools[0], remote_pools=pools[1])

        run(f"{name}:fresh", lambda rp=read_post: t.post_read(rp()), (lo, ro, nb))
        run(f"{name}:prepped", lambda rp=read_post: poster.post(rp()), (lo, ro, nb))
    poster.close()
    t.close()
    conn.send(out)


def raw_nixl(nbytes: int, device: str, gpu: int, repeats: int,
             sets: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], seed: int = 11,
             timeout_s: float = 300.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    stop = ctx.Event()
    target = ctx.Process(target=_target, args=(t_child, stop, nbytes, device, gpu, seed),
                         daemon=True)
    target.start()
    initiator = None
    try:
        if not t_parent.poll(timeout_s):
            raise RuntimeError("NIXL target did not start")
        meta, remote_base = t_parent.recv()
        initiator = ctx.Process(target=_initiator, daemon=True,
                                args=(i_child, meta, remote_base, nbytes, device, gpu, seed,
                                      sets, repeats))
        initiator.start()
        if not i_parent.poll(timeout_s):
            raise RuntimeError("NIXL initiator did not report")
        return i_parent.recv()
    finally:
        end_children(stop, initiator, target)


# ------------------------------------------------------------------ kvd, two daemons


def _as_torch(kv: Any) -> Any:
    """The engine's pool as a torch tensor: CUDA IPC pools already are; shm pools are numpy."""
    import torch

    return kv if isinstance(kv, torch.Tensor) else torch.from_numpy(kv)


def _host_u16(kv: Any) -> np.ndarray:
    """A host copy as uint16 (numpy has no bfloat16), for the layout-aware block check."""
    import torch

    t = _as_torch(kv)
    return t.view(torch.int16).cpu().numpy().view(np.uint16)


def kvd_pulls(nbytes_mib: int, device: str, gpu: int, repeats: int, kv_layout: str,
              seed: int = 7, daemon_args: tuple[str, ...] = (),
              one_daemon: bool = False) -> dict[str, Any]:
    """Pulls of ``nbytes_mib`` (0: one block) between two daemons, or with ``one_daemon``
    between two engines of one daemon (a local pull: the daemon copies between its pools,
    on the GPU with CUDA pools)."""
    from kvd.tools.bench.e2e import check_pulled_blocks, timed_pull
    from kvd.tools.bench.geometry import Geometry
    from kvd.tools.localcluster import DaemonProcess
    from kvd.tools.sim import layout_spec

    geom = Geometry(kv_layout=kv_layout)
    blocks = max(1, nbytes_mib * MiB // geom.block_nbytes)
    pool_blocks = blocks + max(1, blocks // 4)
    rng = random.Random(seed)
    p_ids, d_ids = rng.sample(range(pool_blocks), blocks), rng.sample(range(pool_blocks), blocks)
    logs = Path(tempfile.mkdtemp(prefix="kvd-vram-"))
    extra = ["--device", device, *daemon_args]
    prefill = DaemonProcess.start("vram-prefill", logs, extra_args=extra)
    decode = (prefill if one_daemon
              else DaemonProcess.start("vram-decode", logs, extra_args=extra))
    pc = prefill.client(timeout_s=60)
    dc = pc if one_daemon else decode.client(timeout_s=60)
    model = geom.model()
    try:
        def register(client: Any, engine: str) -> Any:
            return client.register(engine, model, layout_spec(geom.shape(1, pool_blocks)), 0, 1,
                                   device_index=gpu)

        prank, drank = register(pc, "prefill"), register(dc, "decode")
        _random_fill(_as_torch(prank.kv), seed)
        _sync(device)
        _, _, ev = timed_pull(pc, dc, prefill.peer_address, "decode", "warm", p_ids, d_ids)
        _sync(device)
        verified = check_pulled_blocks(_host_u16(prank.kv), [_host_u16(drank.kv)], geom, p_ids,
                                       d_ids)
        totals, daemon = [], []
        for i in range(repeats):
            total, _, ev = timed_pull(pc, dc, prefill.peer_address, "decode", f"p{i}", p_ids,
                                     d_ids)
            totals.append(total)
            daemon.append(ev.duration_s)
        _as_torch(drank.kv).zero_()
        _sync(device)
        timed_pull(pc, dc, prefill.peer_address, "decode", "check", p_ids, d_ids)
        _sync(device)
        verified = verified and check_pulled_blocks(
            _host_u16(prank.kv), [_host_u16(drank.kv)], geom, p_ids, d_ids)
        nbytes = ev.nbytes
        rails = [{"worker": r.worker, "rail": r.rail, "reads": r.reads, "nbytes": r.nbytes}
                 for r in dc.status().rails]
        paths = sorted({p.path for p in dc.status().finished_pulls})
        return {"nbytes": nbytes, "rails": rails, "blocks": blocks, "pool_blocks": pool_blocks,
                "paths": paths, "kvd_p50_ms": round(statistics.median(totals) * 1e3, 3),
                "p_ids": p_ids, "d_ids": d_ids, "geometry": geom.to_json(),
                "kvd_gbps": round(nbytes / statistics.median(totals) / 1e9, 2),
                "kvd_daemon_gbps": round(nbytes / statistics.median(daemon) / 1e9, 2),
                "kvd_ms": [round(x * 1e3, 3) for x in totals], "verified": verified,
                "logs": str(logs)}
    finally:
        pc.close()
        if not one_daemon:
            dc.close()
            decode.stop()
        prefill.stop()


def run_vram(nbytes_mib: int = 512, device: str = "cuda", gpu: int = 0, repeats: int = 5,
             kv_layout: str = DEFAULT_KV_LAYOUT, seed: int = 7,
             posting_workers: str = "auto") -> dict[str, Any]:
    started = time.perf_counter()
    _torch_device(device, gpu)  # refuse early without a GPU
    from kvd.tools.bench.geometry import HOMOGENEOUS, Geometry

    geom = Geometry(kv_layout=kv_layout)
    blocks = max(1, nbytes_mib * MiB // geom.block_nbytes)
    nbytes = blocks * geom.block_nbytes
    pool_blocks = blocks + max(1, blocks // 4)
    rng = random.Random(seed)
    p_ids, d_ids = rng.sample(range(pool_blocks), blocks), rng.sample(range(pool_blocks), blocks)
    sets = []
    try:
        from kvd.tools.bench.geometry import kvd_descriptors

        lo, ro, nb, _, _ = kvd_descriptors(geom, HOMOGENEOUS, pool_blocks, pool_blocks, p_ids,
                                           d_ids)
        sets.append(("kvd_descriptors", lo, ro, nb))
    except (ImportError, TypeError, AttributeError):  # geometry.py being rewritten
        pass
    ceiling = copy_ceiling(nbytes, device, gpu, repeats)
    copier = (copier_on_descriptors(pool_blocks * geom.block_nbytes, sets[0][1:], gpu, repeats)
              if device == "cuda" and sets else None)
    raw = raw_nixl(pool_blocks * geom.block_nbytes, device, gpu, repeats, sets)
    kvd = kvd_pulls(nbytes_mib, device, gpu, repeats, kv_layout, seed,
                    daemon_args=("--set", f"posting_workers={posting_workers}"))
    # Both engines on one daemon: the pull is a copy inside it (on the GPU with CUDA
    # pools), judged against the device copy of the same bytes above; and 1-block pulls,
    # local and between two daemons, for the latency.
    local = kvd_pulls(nbytes_mib, device, gpu, repeats, kv_layout, seed, one_daemon=True)
    latency = max(20, repeats)
    one_local = kvd_pulls(0, device, gpu, latency, kv_layout, seed, one_daemon=True)
    one_remote = kvd_pulls(0, device, gpu, latency, kv_layout, seed)

    def gbps(name: str, n: int) -> float | None:
        return round(n / statistics.median(raw[name]) / 1e9, 2) if name in raw else None

    pool_nbytes = pool_blocks * geom.block_nbytes
    result = {
        "device": device, "gpu": gpu, "nbytes": nbytes, "kv_layout": kv_layout,
        "posting_workers": posting_workers,
        "copy_gbps": ceiling,
        "nixl_gbps": gbps("single", pool_nbytes),
        "nixl_kvd_descriptors_fresh_gbps": gbps("kvd_descriptors:fresh", nbytes),
        "nixl_kvd_descriptors_prepped_gbps": gbps("kvd_descriptors:prepped", nbytes),
        "descriptors": len(sets[0][3]) if sets else None,
        "kvd_gbps": kvd["kvd_gbps"], "kvd_daemon_gbps": kvd["kvd_daemon_gbps"],
        "kvd_ms": kvd["kvd_ms"], "rails": kvd["rails"],
        "posting_workers_used": max(1, len(kvd["rails"])),
        "verified": bool(kvd["verified"] and all(v for k, v in raw.items()
                                                  if k.endswith(":verified"))),
        "raw_verified": {k: v for k, v in raw.items() if k.endswith(":verified")},
        "logs": kvd["logs"], "seconds": round(time.perf_counter() - started, 1),
        "local_gbps": local["kvd_gbps"], "local_daemon_gbps": local["kvd_daemon_gbps"],
        "local_paths": local["paths"], "local_verified": bool(local["verified"]),
        "ratio_local_copy": round(local["kvd_gbps"] / ceiling, 3) if ceiling else None,
        "ratio_local_daemon_copy": round(local["kvd_daemon_gbps"] / ceiling, 3)
        if ceiling else None,
        "copier_kvd_descriptors": copier,
        "ratio_copier_copy": round(copier["gbps"] / ceiling, 3) if copier and ceiling
        else None,
        "one_block_local_p50_ms": one_local["kvd_p50_ms"],
        "one_block_remote_p50_ms": one_remote["kvd_p50_ms"],
        "ratio_one_block_local_remote": round(one_local["kvd_p50_ms"]
                                              / one_remote["kvd_p50_ms"], 3),
    }
    result["verified"] = bool(result["verified"] and local["verified"]
                              and one_local["verified"] and one_remote["verified"])
    if result["nixl_gbps"]:
        result["ratio_kvd_nixl"] = round(result["kvd_gbps"] / result["nixl_gbps"], 3)
    result["targets"] = {
        "ratio_local_copy_min": TARGET_LOCAL_COPY,
        "ratio_one_block_local_remote_max": TARGET_LOCAL_1BLOCK_RATIO,
        "one_block_local_p50_ms_max": TARGET_LOCAL_1BLOCK_P50_MS,
        "met": {"local_copy": bool(result["ratio_local_copy"] is not None
                                   and result["ratio_local_copy"] >= TARGET_LOCAL_COPY),
                "local_1block": result["ratio_one_block_local_remote"]
                <= TARGET_LOCAL_1BLOCK_RATIO,
                "local_1block_p50": result["one_block_local_p50_ms"]
                <= TARGET_LOCAL_1BLOCK_P50_MS}}
    if device == "cuda":
        import torch

        result["gpu_name"] = torch.cuda.get_device_name(gpu)
    return result


def render_vram(r: dict[str, Any]) -> str:
    what = f"{r['device']}" + (f" ({r.get('gpu_name')}, GPU {r['gpu']})"
                               if r["device"] == "cuda" else " (DRAM stand-in)")
    return "\n".join([
        f"VRAM -> VRAM bench on {what}: {r['nbytes'] // MiB} MiB, layout {r['kv_layout']}, "
        f"random block ids, posting workers {r.get('posting_workers_used')} "
        f"({r.get('posting_workers', 'auto')}), GB/s (medians)",
        f"  copy on the device (D2D)          {r['copy_gbps']}",
        f"  raw NIXL READ, 1 descriptor       {r['nixl_gbps']}",
        f"  raw NIXL, kvd's {r['descriptors']} descriptors, fresh list    "
        f"{r['nixl_kvd_descriptors_fresh_gbps']}",
        f"  raw NIXL, kvd's descriptors, PreppedPoster  {r['nixl_kvd_descriptors_prepped_gbps']}",
        f"  kvd end to end (client)           {r['kvd_gbps']}  "
        f"(daemon's own duration: {r['kvd_daemon_gbps']})",
        f"  kvd / raw NIXL 1 descriptor       {r.get('ratio_kvd_nixl')}",
        f"  kvd local (one daemon, {','.join(r.get('local_paths', []))})  {r.get('local_gbps')}"
        f"  = {r.get('ratio_local_copy')}x the device copy (daemon's own duration "
        f"{r.get('ratio_local_daemon_copy')}x; the copier alone on kvd's descriptors "
        f"{r.get('ratio_copier_copy')}x)",
        f"  1-block p50 ms: local {r.get('one_block_local_p50_ms')}, two daemons "
        f"{r.get('one_block_remote_p50_ms')} ({r.get('ratio_one_block_local_remote')}x)",
        f"  targets met: {r.get('targets', {}).get('met')}",
        f"  verified: {r['verified']} {r['raw_verified']}; {r['seconds']} s; logs {r['logs']}",
    ])
