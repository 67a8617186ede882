"""A small repro of the producer's UCX crash when a consumer severs its READs.

Two processes on loopback, UCX over TCP only (``UCX_TLS=tcp``: a READ is emulated with
GET request/reply active messages, as between nodes). The consumer posts one READ of
many descriptors, lets it run ``--sever-after-s``, then aborts its TCP connections to
the producer in the kernel (`kvd.transport.remote.sockets.shut_connections_to`: a reset, what
kvd's quarantine does). The producer, which has GET replies queued in its endpoint's
pending queue, then fails the endpoint; UCX 1.23 may SIGSEGV there. Prints one line per
round: ``producer rc`` (``-11``: the crash) and how the READ ended.

    python tests/support/multinode/ucx_purge_repro.py --rounds 20

Not a test (minutes, and it counts a crash rather than asserting): the multinode
frozen-producer test is the proof; this is the quick way to measure a UCX setting.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import numpy as np


def _agent(name: str):  # noqa: ANN202 - nixl's type
    from kvd.transport.remote.nixl import import_nixl

    api = import_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                      backends=["UCX"]))


def producer(meta_path: str, nbytes: int, zero_heap: bool) -> int:
    """Register a buffer, write its metadata, then progress UCX until killed."""
    if os.environ.get("REPRO_CORES"):  # a core file per crash, in the producer's cwd
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2)
    if zero_heap:  # what kvd's NixlTransport does before its agent
        from kvd.transport.remote.ucx_heap import zero_fresh_heap

        assert zero_fresh_heap()
    agent = _agent("P")
    buf = np.full(nbytes, 0x5A, dtype=np.uint8)
    descs = agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    meta = agent.get_agent_metadata()
    with open(meta_path + ".tmp", "wb") as f:
        f.write(np.uint64(buf.ctypes.data).tobytes() + bytes(meta))
    os.rename(meta_path + ".tmp", meta_path)
    del descs
    while True:  # kvd's NIXL thread polls the same way (no progress thread)
        agent.get_new_notifs()


def consumer(meta_path: str, nbytes: int, desc_bytes: int, sever_after_s: float,
             freeze_pid: int) -> str:
    from kvd.transport.remote.sockets import shut_connections_to

    with open(meta_path, "rb") as f:
        raw = f.read()
    remote_addr, meta = int(np.frombuffer(raw[:8], dtype=np.uint64)[0]), raw[8:]
    agent = _agent("C")
    buf = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta)
    n = nbytes // desc_bytes
    order = np.random.default_rng(1).permutation(n)  # scattered: no merging
    local = np.stack([buf.ctypes.data + np.arange(n) * desc_bytes,
                      np.full(n, desc_bytes), np.zeros(n)], axis=1).astype(np.int64)
    remote = np.stack([remote_addr + order * desc_bytes, np.full(n, desc_bytes),
                       np.zeros(n)], axis=1).astype(np.int64)
    ldl = agent.get_xfer_descs(local, "DRAM")
    rdl = agent.get_xfer_descs(remote, "DRAM")
    handle = agent.initialize_xfer("READ", ldl, rdl, peer)
    agent.transfer(handle)
    deadline = time.monotonic() + sever_after_s
    state = "PROC"
    while time.monotonic() < deadline and state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "PROC":
        return f"READ ended before the sever: {state}"
    if freeze_pid:
        os.kill(freeze_pid, signal.SIGSTOP)
    shut = shut_connections_to(["127.0.0.1"])
    if freeze_pid:
        time.sleep(0.2)
        os.kill(freeze_pid, signal.SIGCONT)
    t0 = time.monotonic()
    try:
        while agent.check_xfer_state(handle) == "PROC":
            if time.monotonic() - t0 > 10:
                return f"severed {shut}: READ still running after 10 s"
    except Exception as exc:  # noqa: BLE001 - how it ended is the result
        return f"severed {shut}: READ failed ({type(exc).__name__})"
    return f"severed {shut}: READ state {agent.check_xfer_state(handle)}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="")
    ap.add_argument("--meta", default="")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--desc-kib", type=int, default=64)
    ap.add_argument("--sever-after-s", type=float, default=0.05)
    ap.add_argument("--freeze", action="store_true", help="SIGSTOP the producer around the sever")
    ap.add_argument("--zero-heap", action="store_true",
                    help="the producer applies kvd.transport.remote.ucx_heap (kvd's workaround)")
    ap.add_argument("--alternate", action="store_true",
                    help="every other round with --zero-heap: both arms in one run")
    ap.add_argument("--producer-env", action="append", default=[],
                    help="NAME=VALUE for the producer only (e.g. GLIBC_TUNABLES=...)")
    a = ap.parse_args()
    nbytes = a.mib << 20
    if a.role == "producer":
        return producer(a.meta, nbytes, a.zero_heap)
    if a.role == "consumer":
        print(consumer(a.meta, nbytes, a.desc_kib << 10, a.sever_after_s,
                       int(os.environ.get("REPRO_FREEZE_PID", "0"))), flush=True)
        return 0
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")}
    crashes = {False: 0, True: 0}
    rounds = {False: 0, True: 0}
    for i in range(a.rounds):
        zero = a.zero_heap or (a.alternate and i % 2 == 1)
        meta = f"/tmp/ucx_purge_repro.{os.getpid()}.{i}"
        penv = dict(env, **dict(kv.split("=", 1) for kv in a.producer_env))
        p = subprocess.Popen([sys.executable, __file__, "--role", "producer", "--meta", meta,
                              "--mib", str(a.mib)] + ["--zero-heap"] * zero, env=penv,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(meta):
                if p.poll() is not None:
                    raise SystemExit(f"producer exited {p.returncode} before starting")
                time.sleep(0.01)
            cenv = dict(env, REPRO_FREEZE_PID=str(p.pid if a.freeze else 0))
            c = subprocess.run([sys.executable, __file__, "--role", "consumer", "--meta", meta,
                                "--mib", str(a.mib), "--desc-kib", str(a.desc_kib),
                                "--sever-after-s", str(a.sever_after_s)],
                               env=cenv, capture_output=True, text=True, timeout=120)
            time.sleep(0.5)  # the producer's progress meets the failed endpoint
            rc = p.poll()
            crashes[zero] += rc == -signal.SIGSEGV
            rounds[zero] += 1
            print(f"round {i}{' (zero heap)' * zero}: producer rc {rc}; consumer: "
                  f"{(c.stdout.strip().splitlines() or [c.stderr.strip()[-300:]])[-1]}", flush=True)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            for path in (meta, meta + ".tmp"):
                if os.path.exists(path):
                    os.unlink(path)
    for zero in (False, True):
        if rounds[zero]:
            print(f"{'with' if zero else 'without'} kvd.transport.remote.ucx_heap: "
                  f"producer crashed in {crashes[zero]}/{rounds[zero]} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
