#!/usr/bin/env python3
"""One call on a GPU machine: the CUDA copier's tests, then its figures, as JSON.

    PYTHONPATH=. python3 scripts/gpu_check_local_copy.py [--out FILE] [--quick]

Needs only torch (CUDA build), numpy, pytest and hypothesis: kvd is imported from the
checkout (PYTHONPATH=.), not installed, so a bare GPU image with PyTorch runs it.

1. pytest: tests/transport/copies/test_cudacopy_cuda.py (real GPU), test_cudacopy_plan.py and
   test_localcopy.py (CPU), without the suite's conftest (it needs kvd's full deps).
2. 1 GiB device-to-device: CudaCopier (1/2/4 streams, per-piece cudaMemcpyAsync and,
   where the runtime has it, cudaMemcpyBatchAsync) against torch's copy of one
   contiguous 1 GiB tensor, timed in the same round, rounds alternating; shapes:
   one descriptor, 2 MiB blocks shuffled, 128 KiB TP1->TP2 halves, 16 KiB pieces.
   Every method's bytes checked against torch once per shape.
3. 1-block latency (64 KiB, 2 MiB): post -> poll True, against torch copy + sync.
4. 256 MiB host<->device: registered (direct) and staged against torch's copy from
   pinned memory.
5. Block copies (``post_blocks``: block ids over a table prepared once, addresses made on
   the GPU), 1 GiB as 512 blocks of 1 x 2 MiB, 8,192 TP1->TP2 halves of 128 KiB (4,096
   blocks x 2 rows) and 512 blocks x 128 rows of 16 KiB (65,536 pieces), each against
   torch's contiguous copy in the same round; the host's time per post; bytes checked
   once per shape; and 1-block latency (2 MiB as 1 row, 2 MiB as 64 rows of 32 KiB).
Prints one JSON object (and writes it to --out, or $OUT/gpu_check_local_copy.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB, GIB = 1 << 20, 1 << 30


def run_tests() -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
           "-o", "addopts=", "tests/transport/copies/test_cudacopy_cuda.py",
           "tests/transport/copies/test_cudacopy_plan.py",
           "tests/transport/copies/test_cudacopy_blocks.py",
           "tests/transport/copies/test_localcopy.py"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
    return {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "summary": tail[-1] if tail else "", "tail": tail}


def shapes(total: int, rng: np.random.Generator) -> dict:
    out = {"contiguous": (np.array([0]), np.array([0]), np.array([total]))}
    nblk = total // (2 * MIB)
    out["blocks_2MiB_shuffled"] = (rng.permutation(nblk) * 2 * MIB,
                                   rng.permutation(nblk) * 2 * MIB, np.full(nblk, 2 * MIB))
    blk, half = 256 << 10, 128 << 10
    nsrc = total // blk
    perm = rng.permutation(nsrc)
    b, h = np.repeat(np.arange(nsrc), 2), np.tile([0, 1], nsrc)
    out["tp1_to_tp2_128KiB"] = (h * (total // 2) + perm[b] * half, b * blk + h * half,
                                np.full(2 * nsrc, half))
    piece = 16 << 10
    npc = total // piece
    out["pieces_16KiB_shuffled"] = (rng.permutation(npc) * piece, rng.permutation(npc) * piece,
                                    np.full(npc, piece))
    return out


def gather_oracle(torch, src, desc, total):
    """The expected destination, built with torch on the GPU (index ranges)."""
    d, s, n = desc
    want = torch.zeros(total, dtype=torch.uint8, device=src.device)
    k = int(n[0])
    if (n == k).all() and total % k == 0:
        want.view(-1, k)[torch.as_tensor(d // k, device=src.device)] = \
            src.view(-1, k)[torch.as_tensor(s // k, device=src.device)]
    else:
        for da, sa, m in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
            want[da:da + m] = src[sa:sa + m]
    return want


def bench_d2d(torch, CudaCopier, total: int, rounds: int) -> dict:  # noqa: N803
    rng = np.random.default_rng(1)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    base_src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    base_dst = torch.empty_like(base_src)
    copiers = {"kernel": CudaCopier(kernel=True),
               "copier_1stream": CudaCopier(streams_per_device=1, kernel=False),
               "copier_2stream": CudaCopier(streams_per_device=2, kernel=False)}
    try:
        copiers["copier_1stream_batch"] = CudaCopier(streams_per_device=1, batch=True,
                                                     kernel=False)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        copiers["_batch_unavailable"] = str(e)
    batch_note = copiers.pop("_batch_unavailable", None)
    results: dict = {"batch_unavailable": batch_note, "shapes": {}}
    for name, (d, s, n) in shapes(total, rng).items():
        desc = (d + dst.data_ptr(), s + src.data_ptr(), n)
        want = gather_oracle(torch, src, (d, s, n), total)
        row: dict = {"descriptors": len(n)}
        for label, c in copiers.items():
            dst.zero_()
            torch.cuda.synchronize()
            h = c.post(*desc, dst_devs=0, src_devs=0)
            c.wait(h)
            c.release(h)
            if not torch.equal(dst, want):
                row[label] = {"error": "bytes differ"}
        del want
        times: dict[str, list[float]] = {"torch_copy_contiguous": []}
        times.update({label: [] for label in copiers if label not in row})
        post_s: dict[str, list[float]] = {label: [] for label in times}
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            base_dst.copy_(base_src)
            torch.cuda.synchronize()
            times["torch_copy_contiguous"].append(time.perf_counter() - t0)
            for label in list(times)[1:]:
                c = copiers[label]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = c.post(*desc, dst_devs=0, src_devs=0)
                t1 = time.perf_counter()
                while not c.poll(h):
                    pass
                t2 = time.perf_counter()
                c.release(h)
                times[label].append(t2 - t0)
                post_s[label].append(t1 - t0)
        base = times["torch_copy_contiguous"]
        for label, ts in times.items():
            row[label] = {
                "ms_p50": round(statistics.median(ts) * 1e3, 3),
                "gbps_p50": round(total / statistics.median(ts) / 1e9, 1),
                "x_torch_copy_p50": round(statistics.median(
                    b / t for b, t in zip(base, ts, strict=True)), 3),
                "post_ms_p50": round(statistics.median(post_s[label]) * 1e3, 3)
                if post_s[label] else None}
        results["shapes"][name] = row
    for c in copiers.values():
        c.close()
    return results


def bench_latency(torch, CudaCopier, reps: int) -> dict:  # noqa: N803
    out = {}
    src = torch.randint(0, 256, (4 * MIB,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for label, c in (("kernel", CudaCopier(streams_per_device=1, kernel=True)),
                     ("memcpy", CudaCopier(streams_per_device=1, kernel=False))):
        for size in (64 << 10, 2 * MIB):
            lat, ref = [], []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = c.post([dst.data_ptr()], [src.data_ptr()], [size], dst_devs=0, src_devs=0)
                while not c.poll(h):
                    pass
                c.release(h)
                lat.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                dst[:size].copy_(src[:size])
                torch.cuda.synchronize()
                ref.append(time.perf_counter() - t0)
            out[f"{label}_{size >> 10}KiB"] = {
                "copier_p50_us": round(statistics.median(lat) * 1e6, 1),
                "copier_p99_us": round(float(np.percentile(lat, 99)) * 1e6, 1),
                "torch_copy_sync_p50_us": round(statistics.median(ref) * 1e6, 1)}
        c.close()
    return out


def bench_host(torch, CudaCopier, HOST, nbytes: int, rounds: int) -> dict:  # noqa: N803
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host = np.zeros(nbytes, dtype=np.uint8)  # a DRAM pool: pageable until registered
    block = 2 * MIB
    n = nbytes // block
    rng = np.random.default_rng(2)
    d_ids, s_ids = rng.permutation(n), rng.permutation(n)
    out = {}
    for mode in ("staged", "registered"):
        c = CudaCopier(streams_per_device=1)
        if mode == "registered":
            c.register_host(host.ctypes.data, host.nbytes)
        for direction in ("d2h", "h2d"):
            ts, base = [], []
            for _ in range(rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if direction == "d2h":
                    pinned.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize()
                base.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                if direction == "d2h":
                    h = c.post(d_ids * block + host.ctypes.data, s_ids * block + dev.data_ptr(),
                               np.full(n, block), dst_devs=HOST, src_devs=0)
                else:
                    h = c.post(d_ids * block + dev.data_ptr(), s_ids * block + host.ctypes.data,
                               np.full(n, block), dst_devs=0, src_devs=HOST)
                while not c.poll(h):
                    pass
                c.release(h)
                ts.append(time.perf_counter() - t0)
            out[f"{direction}_{mode}"] = {
                "gbps_p50": round(nbytes / statistics.median(ts) / 1e9, 1),
                "x_torch_pinned_copy_p50": round(statistics.median(
                    b / t for b, t in zip(base, ts, strict=True)), 3),
                "torch_pinned_gbps_p50": round(nbytes / statistics.median(base) / 1e9, 1)}
        # correctness of the last direction (h2d): dev holds host's blocks
        want = host.reshape(n, block)[s_ids]
        got = dev.view(n, block)[torch.as_tensor(d_ids, device="cuda")].cpu().numpy()
        out[f"h2d_{mode}"]["bytes_ok"] = bool(np.array_equal(got, want))
        c.close()
    return out


def block_shapes(total: int, rng: np.random.Generator) -> dict:
    """(rows as (dst offset, src offset, nbytes, dst stride, src stride), pool blocks on
    each side, dst ids, src ids) per shape; offsets from each buffer's base."""
    out = {}
    n = total // (2 * MIB)
    one = np.array([0]), np.array([0]), np.array([2 * MIB]), np.array([2 * MIB]), \
        np.array([2 * MIB])
    out["blocks_2MiB_shuffled"] = (one, n, n, rng.permutation(n), rng.permutation(n))
    blk, half = 256 << 10, 128 << 10
    nsrc = total // blk
    j = np.arange(2)
    rows = (j * (total // 2), j * half, np.full(2, half), np.full(2, half), np.full(2, blk))
    out["tp1_to_tp2_128KiB"] = (rows, nsrc, nsrc, rng.permutation(nsrc), np.arange(nsrc))
    seg, nb = 16 << 10, 512
    r = total // nb // seg  # 128 rows a block: layer-major, 16 KiB segments
    j = np.arange(r)
    rows = (j * nb * seg, j * nb * seg, np.full(r, seg), np.full(r, seg), np.full(r, seg))
    out["pieces_16KiB_512x128"] = (rows, nb, nb, rng.permutation(nb), rng.permutation(nb))
    return out


def bench_blocks(torch, CudaCopier, total: int, rounds: int) -> dict:  # noqa: N803
    from kvd.planner.blocks import BlockCopy, BlockTable

    rng = np.random.default_rng(4)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    base_src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    base_dst = torch.empty_like(base_src)
    c = CudaCopier(streams_per_device=1)
    t0 = time.perf_counter()
    ready = c.wait_kernels(120)
    out: dict = {"kernels_ready": ready, "kernel_error": c.kernel_error,
                 "kernel_compile_s": c.kernel_compile_s,
                 "waited_for_kernels_s": round(time.perf_counter() - t0, 3), "shapes": {}}

    def table(rows, dn, sn):
        do, so, nb, ds, ss = rows
        return BlockTable(do + dst.data_ptr(), so + src.data_ptr(), nb, ds, ss, 0, 0, dn, sn)

    for name, (rows, dn, sn, d_ids, s_ids) in block_shapes(total, rng).items():
        t = table(rows, dn, sn)
        bc = BlockCopy(t, d_ids, s_ids)
        d, s, n, _, _ = bc.expand()
        want = gather_oracle(torch, src, (d - dst.data_ptr(), s - src.data_ptr(), n), total)
        dst.zero_()
        torch.cuda.synchronize()
        h = c.post_blocks(bc)
        c.wait(h)
        c.release(h)
        row: dict = {"pieces": len(n), "blocks": len(d_ids), "rows": len(t),
                     "path": c.last_block_path, "bytes_ok": bool(torch.equal(dst, want))}
        del want
        base, ts, post = [], [], []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            base_dst.copy_(base_src)
            torch.cuda.synchronize()
            base.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = c.post_blocks(bc)
            t1 = time.perf_counter()
            while not c.poll(h):
                pass
            t2 = time.perf_counter()
            c.release(h)
            ts.append(t2 - t0)
            post.append(t1 - t0)
        row.update({"ms_p50": round(statistics.median(ts) * 1e3, 3),
                    "gbps_p50": round(total / statistics.median(ts) / 1e9, 1),
                    "x_torch_copy_p50": round(statistics.median(
                        b / x for b, x in zip(base, ts, strict=True)), 3),
                    "post_us_p50": round(statistics.median(post) * 1e6, 1),
                    "torch_copy_ms_p50": round(statistics.median(base) * 1e3, 3)})
        out["shapes"][name] = row
    posts = [r["post_us_p50"] for r in out["shapes"].values()]
    out["post_us_max_over_min"] = round(max(posts) / min(posts), 2)
    lat = {}
    for label, rows_n in (("2MiB_1row", 1), ("2MiB_64rows_32KiB", 64)):
        seg = 2 * MIB // rows_n
        j = np.arange(rows_n)
        t = BlockTable(dst.data_ptr() + j * 64 * seg, src.data_ptr() + j * 64 * seg,
                       np.full(rows_n, seg), np.full(rows_n, seg), np.full(rows_n, seg), 0, 0,
                       64, 64)
        ls, ref = [], []
        for i in range(300):
            bc = BlockCopy(t, (i % 64,), ((i * 7) % 64,))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = c.post_blocks(bc)
            while not c.poll(h):
                pass
            c.release(h)
            ls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst[:2 * MIB].copy_(src[:2 * MIB])
            torch.cuda.synchronize()
            ref.append(time.perf_counter() - t0)
        lat[label] = {"copier_p50_us": round(statistics.median(ls) * 1e6, 1),
                      "copier_p99_us": round(float(np.percentile(ls, 99)) * 1e6, 1),
                      "torch_copy_sync_p50_us": round(statistics.median(ref) * 1e6, 1)}
    out["one_block_latency"] = lat
    c.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 256 MiB")
    ap.add_argument("--no-tests", action="store_true")
    args = ap.parse_args()
    import torch

    from kvd.transport.copies.cudacopy import HOST, CudaCopier

    result: dict = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        result["error"] = "no CUDA device"
        print(json.dumps(result, indent=1))
        return 2
    result["device"] = torch.cuda.get_device_name(0)
    result["device_count"] = torch.cuda.device_count()
    if not args.no_tests:
        result["tests"] = run_tests()
    total = 256 * MIB if args.quick else GIB
    rounds = 3 if args.quick else 7
    steps = (("d2d_1GiB" if not args.quick else "d2d_256MiB",
              lambda: bench_d2d(torch, CudaCopier, total, rounds)),
             ("one_block_latency", lambda: bench_latency(torch, CudaCopier,
                                                         50 if args.quick else 300)),
             ("host_256MiB", lambda: bench_host(torch, CudaCopier, HOST, 256 * MIB, rounds)),
             ("blocks_1GiB" if not args.quick else "blocks_256MiB",
              lambda: bench_blocks(torch, CudaCopier, total, rounds)))
    for key, step in steps:
        try:
            result[key] = step()
        except Exception as e:  # noqa: BLE001 - one failing step must not hide the rest
            result[key] = {"error": f"{type(e).__name__}: {e}"}
    text = json.dumps(result, indent=1)
    print(text)
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_check_local_copy.json")
                       if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(text)
    ok = result.get("tests", {}).get("rc", 0) == 0 and not any(
        isinstance(v, dict) and "error" in v for v in result.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
