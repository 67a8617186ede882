"""Which copy primitive a daemon-local pull should use, measured (not a test).

    flock /tmp/kvd-cpu.lock .venv/bin/python benchmarks/bench_local_copy.py --json

Copies 512 MiB between two DRAM buffers of this process, two descriptor shapes:
``fragmented`` (2 MiB blocks, shuffled ids on both sides), ``sliced`` (256 KiB
producer blocks cut in two 128 KiB head halves going to two consumer ranks' pools,
shuffled: TP1 -> TP2) and ``pieces_16KiB`` (shuffled 16 KiB descriptors, the size of
a head range at high TP). Each primitive copies the plan's pieces on one thread; the
`LocalCopier` runs with 1 and 2 copy threads, with the batched C memcpy (native) and
with ctypes.memmove per descriptor. The baseline is a single-thread memcpy
of the same bytes (numpy copyto of one contiguous 512 MiB buffer), timed in the same
round; methods alternate within each round, and ratios are taken per round, then the
median. Every method's result is checked byte-exact against a numpy oracle once.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import statistics
import sys
import time

import numpy as np

from kvd.transport.copies.copyplan import plan_copy
from kvd.transport.copies.localcopy import LocalCopier
from kvd.transport.remote.nixl import import_nixl

MIB = 1 << 20


def aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + nbytes]


def scenarios(total: int, src_base: int, dst_base: int, rng: np.random.Generator):
    nblk = total // (2 * MIB)
    s, d = rng.permutation(nblk), rng.permutation(nblk)
    frag = (dst_base + d * 2 * MIB, src_base + s * 2 * MIB, np.full(nblk, 2 * MIB))
    blk, half = 256 * 1024, 128 * 1024
    nsrc = total // blk
    perm = rng.permutation(nsrc)
    b = np.repeat(np.arange(nsrc), 2)
    h = np.tile([0, 1], nsrc)
    sliced = (dst_base + h * (total // 2) + perm[b] * half, src_base + b * blk + h * half,
              np.full(2 * nsrc, half))
    piece = 16 << 10
    npc = total // piece
    small = (dst_base + rng.permutation(npc) * piece, src_base + rng.permutation(npc) * piece,
             np.full(npc, piece))
    return {"fragmented": frag, "sliced": sliced, "pieces_16KiB": small}


def oracle(dst: np.ndarray, src: np.ndarray, dst_base: int, src_base: int, desc) -> np.ndarray:
    out = dst.copy()
    for da, sa, n in zip(*(a.tolist() for a in desc), strict=True):
        out[da - dst_base:da - dst_base + n] = src[sa - src_base:sa - src_base + n]
    return out


def make_methods(src: np.ndarray, dst: np.ndarray, nixl_agent):
    import torch

    torch.set_num_threads(1)
    src_base, dst_base = src.ctypes.data, dst.ctypes.data
    src_t, dst_t = torch.from_numpy(src), torch.from_numpy(dst)

    def loop(fn):
        def run(desc):
            piece = plan_copy(*desc, parts=1).parts[0]
            for da, sa, n in zip(piece.dst.tolist(), piece.src.tolist(),
                                 piece.nbytes.tolist(), strict=True):
                fn(da, sa, n)
        return run

    def np_copy(da, sa, n):
        np.copyto(dst[da - dst_base:da - dst_base + n], src[sa - src_base:sa - src_base + n])

    def torch_copy(da, sa, n):
        dst_t[da - dst_base:da - dst_base + n].copy_(src_t[sa - src_base:sa - src_base + n])

    methods = {"memmove": loop(ctypes.memmove), "numpy_copyto": loop(np_copy),
               "torch_copy_": loop(torch_copy)}
    copiers = {(prim, k): LocalCopier(threads=k, primitive=prim)
               for prim in ("memmove", "native") for k in (1, 2)}

    def copier(key):
        def run(desc):
            c = copiers[key]
            h = c.post(*desc)
            c.wait(h)
            c.release(h)
        return run

    for (prim, k), c in copiers.items():
        assert c.primitive == prim
        methods[f"copier_{prim}_{k}thread{'s' if k > 1 else ''}"] = copier((prim, k))
    if nixl_agent is not None:
        methods["nixl_local"] = nixl_agent
    return methods, copiers


def nixl_local(src: np.ndarray, dst: np.ndarray):
    """A READ within one agent (its own name as the remote), or None and why."""
    try:
        api = import_nixl()
    except Exception as e:  # noqa: BLE001
        return None, f"nixl not importable: {e}"
    try:
        logging.getLogger("nixl").setLevel(logging.WARNING)
        agent = api.nixl_agent("local-bench", api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"]))
        agent.register_memory([(src.ctypes.data, src.nbytes, 0, ""),
                               (dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    except Exception as e:  # noqa: BLE001
        return None, f"nixl setup failed: {e!r}"

    def run(desc):
        d, s, n = (np.asarray(a, dtype=np.uint64) for a in desc)
        local = np.stack([d, n, np.zeros_like(n)], axis=1)
        remote = np.stack([s, n, np.zeros_like(n)], axis=1)
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                  agent.get_xfer_descs(remote, "DRAM"), "local-bench")
        state = agent.transfer(h)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        if state == "ERR":
            raise RuntimeError("nixl local READ: ERR")

    try:
        probe = (np.array([dst.ctypes.data]), np.array([src.ctypes.data]), np.array([4096]))
        run(probe)
    except Exception as e:  # noqa: BLE001
        return None, f"nixl local READ failed: {e!r}"
    return run, "ok"


def small_latency(reps: int) -> dict:
    out = {}
    buf_src, buf_dst = aligned(4 * MIB), aligned(4 * MIB)
    with LocalCopier(threads=1) as c:
        for size in (64 * 1024, 256 * 1024, 1 * MIB):
            desc = (np.array([buf_dst.ctypes.data]), np.array([buf_src.ctypes.data]),
                    np.array([size]))
            ts, ms = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                h = c.post(*desc)
                done = c.poll(h)
                c.release(h)
                ts.append(time.perf_counter() - t0)
                assert done
                t0 = time.perf_counter()
                ctypes.memmove(buf_dst.ctypes.data, buf_src.ctypes.data, size)
                ms.append(time.perf_counter() - t0)
            out[f"{size // 1024}KiB"] = {"copier_p50_us": statistics.median(ts) * 1e6,
                                         "memmove_p50_us": statistics.median(ms) * 1e6}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-nixl", action="store_true")
    args = ap.parse_args()
    total = args.mib * MIB
    rng = np.random.default_rng(1)
    src, dst = aligned(total), aligned(total)
    src[:] = rng.integers(0, 256, total, dtype=np.uint8)
    dst[:] = 0
    base_src, base_dst = aligned(total), aligned(total)
    base_src[:] = 1
    agent, nixl_status = (None, "skipped") if args.no_nixl else nixl_local(src, dst)
    methods, copiers = make_methods(src, dst, agent)
    descs = scenarios(total, src.ctypes.data, dst.ctypes.data, rng)
    result: dict = {"mib": args.mib, "rounds": args.rounds, "nixl_local": nixl_status,
                    "scenarios": {}}
    for name, desc in descs.items():
        want = oracle(dst, src, dst.ctypes.data, src.ctypes.data, desc)
        for m, run in methods.items():  # correctness first, once per method
            dst[:] = 0
            run(desc)
            if not np.array_equal(dst, want):
                raise SystemExit(f"{m} on {name}: bytes differ")
        del want
        times: dict[str, list[float]] = {m: [] for m in methods}
        times["memcpy_1thread"] = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            np.copyto(base_dst, base_src)
            times["memcpy_1thread"].append(time.perf_counter() - t0)
            for m, run in methods.items():
                t0 = time.perf_counter()
                run(desc)
                times[m].append(time.perf_counter() - t0)
        base = times["memcpy_1thread"]
        result["scenarios"][name] = {
            "descriptors": len(desc[2]),
            "merged": plan_copy(*desc).merged,
            **{m: {"gbps_p50": total / statistics.median(ts) / 1e9,
                   "x_memcpy_p50": statistics.median(b / t for b, t in zip(base, ts,
                                                                           strict=True))}
               for m, ts in times.items()}}
    result["small_inline"] = small_latency(300)
    for c in copiers.values():
        c.close()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, rows in result["scenarios"].items():
            print(name)
            for m, r in rows.items():
                if isinstance(r, dict):
                    print(f"  {m:18s} {r['gbps_p50']:6.1f} GB/s  {r['x_memcpy_p50']:.2f}x")
        print(json.dumps(result["small_inline"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
