"""The ceilings: memcpy in this process and raw NIXL READ between two spawned processes.

Both run on numpy heap memory ("anon") and on shm pools allocated exactly like kvd's
("shm", in ``shm_dir``), so that kvd can be compared like for like.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from kvd.tools.bench.geometry import DEFAULT_SHM_DIR, fmt_gbps

MEMORY_KINDS = ("anon", "shm")

# RawStream: how long its target spins before each READ starts
SPIN_UP_S = 0.02

# (name, memory kind, local offsets, remote offsets, sizes)
DescSet = tuple[str, str, np.ndarray, np.ndarray, np.ndarray]


def alloc_buffer(kind: str, nbytes: int, shm_dir: str = DEFAULT_SHM_DIR) -> tuple[np.ndarray, Any]:
    """anon: numpy heap memory (numpy asks for transparent huge pages on big arrays);
    shm: a pool exactly like the ones kvd's daemons allocate by default (``pool_backing``
    auto: reserved 2 MiB pages where the host has them free, a huge-page mount in
    ``shm_dir``, else a 4 KiB shm file there), so raw NIXL and memcpy run on the same
    kind of memory as kvd. Unlinked at once: nothing can leak."""
    if kind == "anon":
        return np.empty(nbytes, dtype=np.uint8), None
    from kvd.pool.shm import PoolBacking, ShmPool

    pool = ShmPool.create("kvd-bench", nbytes, shm_dir, backing=PoolBacking.AUTO)
    if pool.fd is None:  # a file; memfd pools have none
        os.unlink(pool.directory / pool.name)
    return pool.array, pool


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


def bench_memcpy(nbytes: int, repeats: int, shm_dir: str = DEFAULT_SHM_DIR) -> dict[str, Any]:
    """Heap-to-heap (numpy asks for huge pages) and shm-to-shm (the pools kvd uses)."""
    times = _copy_times(np.empty(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8),
                        repeats)
    src, src_pool = alloc_buffer("shm", nbytes, shm_dir)
    dst, dst_pool = alloc_buffer("shm", nbytes, shm_dir)
    shm_times = _copy_times(src, dst, repeats)
    del src, dst
    page_nbytes, backing = src_pool.page_nbytes, src_pool.backing.value
    src_pool.close()
    dst_pool.close()
    return {"memcpy_gbps": fmt_gbps(nbytes, statistics.median(times)),
            "memcpy_gbps_best": fmt_gbps(nbytes, min(times)),
            "memcpy_gbps_shm": fmt_gbps(nbytes, statistics.median(shm_times)),
            "shm_buffers_backing": backing, "shm_buffers_page_nbytes": page_nbytes}


# ------------------------------------------------------------------ raw NIXL


def fill_test_pattern(buf: np.ndarray, start: int = 0) -> None:
    """Unique 8-byte words (start + offset / 8), written in chunks to avoid a big
    temporary; distinct ``start``s keep several buffers apart."""
    words = buf.view(np.uint64)
    step = 1 << 20
    for i in range(0, words.size, step):
        n = min(step, words.size - i)
        words[i:i + n] = np.arange(start + i, start + i + n, dtype=np.uint64)


def check_test_pattern(buf: np.ndarray) -> bool:
    words = buf.view(np.uint64)
    step = 1 << 20
    for i in range(0, words.size, step):
        n = min(step, words.size - i)
        if not np.array_equal(words[i:i + n], np.arange(i, i + n, dtype=np.uint64)):
            return False
    return True


def new_agent(name: str) -> Any:
    import logging

    from kvd.transport.remote.nixl import import_nixl

    api = import_nixl()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                      backends=["UCX"]))


def _nixl_target(conn: Any, stop: Any, nbytes: int, shm_dir: str,
                 kinds: tuple[str, ...] = MEMORY_KINDS, spin: Any = None) -> None:
    """Spawned: owns the source buffers and polls notifications until told to stop,
    continuously; with ``spin`` (an Event) only while it is set, else it sleeps (a
    target that spins all along would take a core from kvd measured meanwhile,
    `RawStream`)."""
    agent = new_agent(f"bench-target-{os.getpid()}")
    bases, keep = {}, []
    for kind in kinds:
        buf, owner = alloc_buffer(kind, nbytes, shm_dir)
        fill_test_pattern(buf)  # also pre-faults
        agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
        bases[kind] = int(buf.ctypes.data)
        keep.append((buf, owner))
    conn.send((bytes(agent.get_agent_metadata()), bases))
    notifs = 0
    while not stop.is_set():
        if spin is not None and not spin.wait(0.05):
            continue
        for _ in range(256):
            for msgs in agent.get_new_notifs().values():
                notifs += len(msgs)
    conn.send(notifs)


def _nixl_initiator(conn: Any, meta: bytes, remote_bases: dict[str, int], nbytes: int,
                    sets: list[DescSet], repeats: int, check_set: str, shm_dir: str,
                    kinds: tuple[str, ...] = MEMORY_KINDS) -> None:
    """Spawned: READs each descriptor set (1 warm-up + repeats) and reports seconds.

    A set is (name, memory kind, local offsets, remote offsets, sizes); timed from
    building the transfer (descriptors, initialize_xfer) to DONE, like kvd's post.
    """
    agent = new_agent(f"bench-initiator-{os.getpid()}")
    bufs, keep = {}, []
    for kind in kinds:
        buf, owner = alloc_buffer(kind, nbytes, shm_dir)
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
            out["verified"] = check_test_pattern(buf[: int(nb.sum())])
    conn.send(out)


def bench_nixl(local_nbytes: int, remote_nbytes: int, sets: list[DescSet], repeats: int,
               check_set: str, timeout_s: float = 120.0,
               shm_dir: str = DEFAULT_SHM_DIR,
               kinds: tuple[str, ...] = MEMORY_KINDS) -> dict[str, Any]:
    """``kinds``: the memory kinds to allocate on both sides (each set names one)."""
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    stop = ctx.Event()
    target = spawn(ctx, _nixl_target, t_child, stop, remote_nbytes, shm_dir, kinds)
    initiator = None
    try:
        meta, remote_bases = hear(t_parent, timeout_s, "NIXL target process")
        initiator = spawn(ctx, _nixl_initiator, i_child, meta, remote_bases, local_nbytes,
                          sets, repeats, check_set, shm_dir, kinds)
        res = hear(i_parent, timeout_s, "NIXL initiator")
        stop.set()
        res["target_notifs"] = t_parent.recv() if t_parent.poll(10) else None
        return res
    finally:
        end_children(stop, initiator, target)


def _nixl_stream(conn: Any, meta: bytes, remote_base: int, nbytes: int, shm_dir: str) -> None:
    """Spawned: one descriptor of ``nbytes`` on shm like kvd's pools, READ once per
    request on ``conn`` (timed like `_nixl_initiator`'s sets), until told None."""
    agent = new_agent(f"bench-stream-{os.getpid()}")
    buf, owner = alloc_buffer("shm", nbytes, shm_dir)
    buf.fill(0xFF)  # pre-fault
    agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta)
    local = np.array([[int(buf.ctypes.data), nbytes, 0]], dtype=np.uint64)
    remote = np.array([[remote_base, nbytes, 0]], dtype=np.uint64)

    def read() -> float:
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                       agent.get_xfer_descs(remote, "DRAM"), peer, b"bench")
        state = agent.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("raw NIXL stream READ failed")
            state = agent.check_xfer_state(handle)
        seconds = time.perf_counter() - t0
        agent.release_xfer_handle(handle)
        return seconds

    read()  # warm: connection, page faults
    conn.send("ready")
    while conn.recv() is not None:
        conn.send(read())
    conn.send(check_test_pattern(buf))
    del owner


class RawStream:
    """One raw NIXL READ stream kept open beside kvd (two spawned processes, shm
    memory like kvd's pools, one descriptor: the best single stream), so that the bench
    can time it between kvd's own repeats: both then see the same background load,
    where a baseline measured a minute earlier need not. Its target spins
    (polls NIXL without pause, as `bench_nixl`'s does) only while one of its READs
    runs, so that it takes no core from kvd meanwhile."""

    def __init__(self, nbytes: int, shm_dir: str = DEFAULT_SHM_DIR,
                 timeout_s: float = 120.0, spin_always: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self._t_parent, t_child = ctx.Pipe()
        self._conn, s_child = ctx.Pipe()
        self._stop = ctx.Event()
        self._spin = ctx.Event()
        self._spin.set()  # while the initiator connects (UCX needs the target's progress)
        self._spin_always = spin_always
        self._timeout_s = timeout_s
        self.nbytes = nbytes
        self._target = spawn(ctx, _nixl_target, t_child, self._stop, nbytes, shm_dir,
                             ("shm",), self._spin)
        self._stream = None
        try:
            meta, bases = hear(self._t_parent, timeout_s, "NIXL stream target")
            self._stream = spawn(ctx, _nixl_stream, s_child, meta, bases["shm"], nbytes,
                                 shm_dir)
            hear(self._conn, timeout_s, "NIXL stream initiator")
            if not spin_always:
                self._spin.clear()
        except BaseException:
            end_children(self._stop, self._stream, self._target)
            raise

    def read(self) -> float:
        """Seconds of one READ of ``nbytes``."""
        if not self._spin.is_set():
            self._spin.set()
            time.sleep(SPIN_UP_S)  # the READ starts with its target spinning
        try:
            self._conn.send(True)
            return float(hear(self._conn, self._timeout_s, "NIXL stream initiator"))
        finally:
            if not self._spin_always:
                self._spin.clear()

    def close(self) -> bool:
        """Stop both processes; whether the last READ delivered the expected bytes."""
        try:
            self._conn.send(None)
            return bool(hear(self._conn, self._timeout_s, "NIXL stream initiator"))
        finally:
            self._stop.set()
            if self._t_parent.poll(10):  # the target's last word (its notification count)
                self._t_parent.recv()
            end_children(self._stop, self._stream, self._target)


def spawn(ctx: Any, target: Any, *args: Any) -> Any:
    """A benchmark's child process, started (always reaped by `end_children`)."""
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def hear(conn: Any, timeout_s: float, who: str) -> Any:
    """A child's next message, or an error naming the child that did not report."""
    if not conn.poll(timeout_s):
        raise RuntimeError(f"{who} did not report within {timeout_s} s")
    return conn.recv()


def end_children(stop: Any, *procs: Any) -> None:
    """Tell the benchmark's child processes to stop, then reap them: a NIXL child that
    does not exit within 10 s is killed, so no benchmark leaves a process behind."""
    stop.set()
    for p in procs:
        if p is not None:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
