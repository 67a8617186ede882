"""The floor of a 1-block pull on this machine: kvd's messages and READ, none of its work.

Three processes, as in a kvd pull: this one (the engine), "decode" (uvloop and
zmq.asyncio, like ``kvd serve``) and "prefill" (the same, owning the block's memory).
Per pull the engine sends one request to decode, which sends one request to prefill
(the Acquire), posts a raw NIXL READ of one block meanwhile, waits for the READ and
the reply, and answers. The engine's publish before and its done_sending wait after
are one request to prefill each, paced as in kvd's own latency loop. Nothing else:
no decoding, validation, planning, bookkeeping or metrics.

So ``kvd p50 / floor p50`` is what kvd's own control path costs, in one run, and a
target below the floor is out of reach of any design that keeps a round trip to the
engine and one to the producer on the pull's path.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from kvd.tools.bench.geometry import DEFAULT_SHM_DIR, fmt_ms, fmt_pct
from kvd.tools.bench.raw import (
    alloc_buffer,
    check_test_pattern,
    end_children,
    fill_test_pattern,
    hear,
    new_agent,
    spawn,
)

POOL_BLOCKS = 64  # read in turn, so that every READ comes from memory, not a cache
START_TIMEOUT_S = 60.0
PROGRESS_POLL_MS = 1  # kvd's producer polls NIXL every 1 ms while pulls come in


def _serve_prefill(conn: Any, stop: Any, nbytes: int, shm_dir: str, address: str) -> None:
    """Spawned: owns the blocks (a pool like kvd's), answers every request at once."""
    import asyncio

    import uvloop
    import zmq
    import zmq.asyncio

    agent = new_agent(f"floor-prefill-{os.getpid()}")
    buf, owner = alloc_buffer("shm", nbytes, shm_dir)
    fill_test_pattern(buf)
    agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
    conn.send((bytes(agent.get_agent_metadata()), int(buf.ctypes.data)))

    async def serve() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        while not stop.is_set():
            # UCX progress, as kvd's producer makes it (its notification polls): peers
            # connect through it
            agent.get_new_notifs()
            if not await sock.poll(PROGRESS_POLL_MS):
                continue
            frames = await sock.recv_multipart(copy=False)
            sock.send_multipart([frames[0].bytes, b"answer" * 8], flags=zmq.NOBLOCK)
        sock.close(0)
        ctx.term()

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve())
    del owner


def _serve_decode(conn: Any, stop: Any, meta: bytes, remote_base: int, nbytes: int,
                  block_nbytes: int, shm_dir: str, address: str, prefill_address: str) -> None:
    """Spawned: per request, the Acquire stand-in to prefill and a raw NIXL READ of one
    block (built and posted inline, as kvd posts a small READ), then the answer."""
    import asyncio

    import uvloop
    import zmq
    import zmq.asyncio

    agent = new_agent(f"floor-decode-{os.getpid()}")
    buf, owner = alloc_buffer("shm", nbytes, shm_dir)
    buf.fill(0xFF)  # pre-fault
    base = int(buf.ctypes.data)
    agent.register_memory([(base, nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta)
    agent.make_connection(peer.decode() if isinstance(peer, bytes) else peer)
    blocks = nbytes // block_nbytes

    def read(block: int) -> None:
        local = np.array([[base + block * block_nbytes, block_nbytes, 0]], dtype=np.uint64)
        remote = np.array([[remote_base + block * block_nbytes, block_nbytes, 0]],
                          dtype=np.uint64)
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                       agent.get_xfer_descs(remote, "DRAM"), peer, b"")
        state = agent.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("floor: NIXL READ failed")
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)

    async def serve() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        prefill = ctx.socket(zmq.DEALER)
        prefill.setsockopt(zmq.LINGER, 0)
        prefill.connect(prefill_address)
        pulls = 0
        conn.send("ready")
        while not stop.is_set():
            if not await sock.poll(100):
                continue
            frames = await sock.recv_multipart(copy=False)
            prefill.send_multipart([b"acquire" * 8])
            read(pulls % blocks)
            pulls += 1
            await prefill.recv_multipart()
            sock.send_multipart([frames[0].bytes, b"event" * 32], flags=zmq.NOBLOCK)
        conn.send(check_test_pattern(buf) if pulls >= blocks else None)
        sock.close(0)
        prefill.close(0)
        ctx.term()

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve())
    del owner


class FloorPipeline:
    """The floor's three processes, kept running so that its pulls can be timed between
    kvd's own (both then see the same background load). Its processes wait
    in ``poll`` between pulls, as idle daemons do: they take no core from kvd."""

    def __init__(self, block_nbytes: int, shm_dir: str = DEFAULT_SHM_DIR, warmup: int = 50
                 ) -> None:
        import zmq

        from kvd.tools.localcluster import free_port

        nbytes = block_nbytes * POOL_BLOCKS
        ctx = mp.get_context("spawn")
        p_parent, p_child = ctx.Pipe()
        self._d_parent, d_child = ctx.Pipe()
        self._stop = ctx.Event()
        p_addr, d_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        self._prefill = spawn(ctx, _serve_prefill, p_child, self._stop, nbytes, shm_dir,
                              p_addr)
        self._decode = None
        self._zctx = zmq.Context()
        self.pulls = 0
        try:
            meta, remote_base = hear(p_parent, START_TIMEOUT_S, "floor: the prefill process")
            self._decode = spawn(ctx, _serve_decode, d_child, self._stop, meta, remote_base,
                                 nbytes, block_nbytes, shm_dir, d_addr, p_addr)
            hear(self._d_parent, START_TIMEOUT_S, "floor: the decode process")
            self._to_decode = self._zctx.socket(zmq.DEALER)
            self._to_prefill = self._zctx.socket(zmq.DEALER)
            for sock, addr in ((self._to_decode, d_addr), (self._to_prefill, p_addr)):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, int(START_TIMEOUT_S * 1000))
                sock.connect(addr)
            for _ in range(warmup):
                self.pull()
        except BaseException:
            self._end()
            raise

    def pull(self) -> float:
        """Seconds of one floor pull at the engine (publish and done_sending around it,
        untimed, as kvd's latency loop paces its pulls)."""
        self._to_prefill.send(b"publish" * 16)
        self._to_prefill.recv()
        t0 = time.perf_counter()
        self._to_decode.send(b"pull" * 64)
        self._to_decode.recv()
        seconds = time.perf_counter() - t0
        self._to_prefill.send(b"wait" * 8)
        self._to_prefill.recv()
        self.pulls += 1
        return seconds

    def close(self) -> bool | None:
        """Stop the processes; whether every block read arrived intact (None: too few
        pulls to have read each block)."""
        self._to_decode.close(0)
        self._to_prefill.close(0)
        self._stop.set()
        try:
            return (self._d_parent.recv() if self._d_parent.poll(START_TIMEOUT_S)
                    else None)
        finally:
            self._end()

    def _end(self) -> None:
        end_children(self._stop, self._decode, self._prefill)
        self._zctx.term()


def floor_result(times: list[float], verified: bool | None) -> dict[str, Any]:
    return {"floor_1block_p50_ms": fmt_ms(fmt_pct(times, 50)),
            "floor_1block_p99_ms": fmt_ms(fmt_pct(times, 99)),
            "floor_1block_samples": len(times), "floor_verified": bool(verified)}


def bench_floor(block_nbytes: int, pulls: int, shm_dir: str = DEFAULT_SHM_DIR,
                warmup: int = 50) -> dict[str, Any]:
    """p50/p99 of the floor pipeline's pulls (engine side, like kvd's latency figures),
    and whether the blocks read arrived intact."""
    floor = FloorPipeline(block_nbytes, shm_dir, warmup)
    try:
        times = [floor.pull() for _ in range(max(pulls, POOL_BLOCKS))]
    finally:
        verified = floor.close()
    return floor_result(times, verified)
