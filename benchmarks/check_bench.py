"""An independent check of `kvd bench`: the same question asked another way.

`kvd bench` times pulls at a blocking client (``pull_and_wait``, one round trip) and
computes ratios from its own clocks. This script shares none of that code path:

- engines are an ``AsyncKvdClient`` with a **poller task parked in a long poll**, as
  vLLM's connector runs (the scheduler sends ``pull``; a separate poll loop sees the
  event), with the publish receipt passed along;
- kvd's throughput is also read from the **decode daemon's Prometheus counters**
  (``kvd_transferred_bytes_total`` over ``kvd_transfer_duration_seconds_sum``), i.e. the
  daemon's own accounting, not a client clock;
- memcpy is timed here with ``ctypes.memmove`` on pools allocated by ``kvd.pool.shm``
  (``pool_backing`` auto, the same memory kind kvd uses), and raw NIXL with the bench's
  one-descriptor READ (the ceiling it compares against);
- the pulled bytes are checked against an independent pattern (a seeded hash per
  block), not the bench's fill.

Run: .venv/bin/python benchmarks/check_bench.py [--nbytes-mib 512] [--repeats 5]
     [--latency-pulls 200] [--json]
Prints one line per figure next to its target; compare with `kvd bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.client import AsyncKvdClient
from kvd.pool.shm import PoolBacking, ShmPool
from kvd.tools.bench.geometry import Geometry
from kvd.tools.bench.raw import bench_nixl
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import layout_spec

MiB = 1 << 20


def memmove_gbps(nbytes: int, repeats: int) -> float:
    pools = [ShmPool.create("kvd-check", nbytes, "/dev/shm", backing=PoolBacking.AUTO)
             for _ in range(2)]
    for p in pools:
        if p.fd is None:  # a file (memfd pools have none): unlinked now, nothing can leak
            os.unlink(p.directory / p.name)
    try:
        src, dst = (p.array.reshape(-1).view(np.uint8) for p in pools)
        src.fill(3)
        dst.fill(0)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times[1:]) / 1e9
    finally:
        for p in pools:
            p.close()


def fill_blocks(kv: np.ndarray, block_nbytes: int, ids: list[int], seed: int) -> None:
    flat = kv.reshape(-1).view(np.uint8)
    rng = np.random.default_rng(seed)
    for b in ids:
        flat[b * block_nbytes:(b + 1) * block_nbytes] = rng.integers(
            0, 256, block_nbytes, dtype=np.uint8)


def same_blocks(src: np.ndarray, dst: np.ndarray, block_nbytes: int, s_ids: list[int],
                d_ids: list[int]) -> bool:
    s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    return all(np.array_equal(s[a * block_nbytes:(a + 1) * block_nbytes],
                              d[b * block_nbytes:(b + 1) * block_nbytes])
               for a, b in zip(s_ids, d_ids, strict=True))


class Poller:
    """A task parked in a long poll, delivering events to waiters (the vLLM pattern)."""

    def __init__(self, client: AsyncKvdClient, engine_id: str) -> None:
        self.client, self.engine_id = client, engine_id
        self.waiters: dict[str, asyncio.Future[Any]] = {}
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            for ev in await self.client.poll(self.engine_id, timeout_s=1.0):
                fut = self.waiters.pop(ev.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result((time.perf_counter(), ev))

    def expect(self, request_id: str) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = fut
        return fut


async def run_kvd(geom: Geometry, blocks: int, repeats: int, latency_pulls: int,
                  logs: Path) -> dict[str, Any]:
    prefill = DaemonProcess.start("check-prefill", logs)
    decode = DaemonProcess.start("check-decode", logs)
    pc = AsyncKvdClient(prefill.engine_address, timeout_s=30, ping_interval_s=0)
    dc = AsyncKvdClient(decode.engine_address, timeout_s=30, ping_interval_s=0)
    dpoll = AsyncKvdClient(decode.engine_address, timeout_s=30, ping_interval_s=0)
    ppoll = AsyncKvdClient(prefill.engine_address, timeout_s=30, ping_interval_s=0)
    out: dict[str, Any] = {}
    try:
        pool_blocks = blocks + max(1, blocks // 4)
        model = geom.model()
        pr = await pc.register("p", model, layout_spec(geom.shape(1, pool_blocks)), 0, 1)
        dr = await dc.register("d", model, layout_spec(geom.shape(1, pool_blocks)), 0, 1)
        rng = random.Random(11)
        p_ids = rng.sample(range(pool_blocks), blocks)
        d_ids = rng.sample(range(pool_blocks), blocks)
        fill_blocks(pr.kv, geom.block_nbytes, p_ids, seed=5)
        dpoller, ppoller = Poller(dpoll, "d"), Poller(ppoll, "p")
        addr = prefill.peer_address

        async def pull(rid: str, src: list[int], dst: list[int]) -> tuple[float, Any]:
            sent = ppoller.expect(rid)
            receipt = await pc.publish("p", rid, src)
            got = dpoller.expect(rid)
            t0 = time.perf_counter()
            await dc.pull("d", rid, "p", addr, src, dst, publish_receipt=receipt)
            t1, ev = await got
            if not ev.ok:
                raise RuntimeError(f"{rid}: {ev.error}")
            await sent
            return t1 - t0, ev

        await pull("warm", p_ids, d_ids)
        ok = same_blocks(pr.kv, dr.kv, geom.block_nbytes, p_ids, d_ids)
        nbytes0 = decode.metric("kvd_transferred_bytes_total")
        secs0 = decode.metric("kvd_transfer_duration_seconds_sum", role="consumer")
        times = [(await pull(f"big-{i}", p_ids, d_ids))[0] for i in range(repeats)]
        nbytes = decode.metric("kvd_transferred_bytes_total") - nbytes0
        secs = decode.metric("kvd_transfer_duration_seconds_sum", role="consumer") - secs0
        dr.kv.reshape(-1).view(np.uint8)[:] = 0
        await pull("check", p_ids, d_ids)
        ok = ok and same_blocks(pr.kv, dr.kv, geom.block_nbytes, p_ids, d_ids)
        out["kvd_client_gbps"] = blocks * geom.block_nbytes / statistics.median(times) / 1e9
        out["kvd_daemon_metrics_gbps"] = nbytes / secs / 1e9
        out["verified"] = ok
        for i in range(20):
            await pull(f"lw-{i}", p_ids[:1], d_ids[:1])
        lat = sorted([(await pull(f"l-{i}", p_ids[:1], d_ids[:1]))[0]
                      for i in range(latency_pulls)])
        out["pull_1block_p50_ms"] = 1e3 * lat[len(lat) // 2]
        out["pull_1block_p99_ms"] = 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        dpoller.task.cancel()
        ppoller.task.cancel()
        return out
    finally:
        for c in (pc, dc, dpoll, ppoll):
            c.close()
        prefill.stop()
        decode.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--latency-pulls", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    geom = Geometry()
    blocks = a.nbytes_mib * MiB // geom.block_nbytes
    nbytes = blocks * geom.block_nbytes
    res: dict[str, Any] = {"memcpy_gbps": memmove_gbps(nbytes, a.repeats)}
    one = np.array([0], dtype=np.int64)
    nixl = bench_nixl(nbytes, nbytes, [("single:shm", "shm", one, one.copy(),
                                        np.array([nbytes], dtype=np.int64))],
                      a.repeats, check_set="single:shm", kinds=("shm",))
    res["nixl_gbps_shm"] = nbytes / statistics.median(nixl["single:shm"]) / 1e9
    res.update(asyncio.run(run_kvd(geom, blocks, a.repeats, a.latency_pulls,
                                   Path(tempfile.mkdtemp(prefix="kvd-check-")))))
    res["ratio_kvd_memcpy"] = res["kvd_client_gbps"] / res["memcpy_gbps"]
    res["ratio_kvd_nixl_shm"] = res["kvd_client_gbps"] / res["nixl_gbps_shm"]
    res["ratio_daemon_nixl_shm"] = res["kvd_daemon_metrics_gbps"] / res["nixl_gbps_shm"]
    res = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:26s} {v}")
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
