"""Rails and posting workers: how many, on which network devices, built how.

A rail is one network device (a NIC, an IB HCA port, or a veth in tests) that a
posting worker's UCX is restricted to (the UCX plugin's ``ucx_devices``, what
UCX_NET_DEVICES does for a whole process). ``rails = "auto"`` picks, for each GPU,
the NIC nearest it on the PCIe tree (the longest common sysfs path, what
``nvidia-smi topo -m`` calls PIX/PXB before NODE/SYS), the NUMA node breaking ties,
as Mooncake's transfer engine does; a host without GPUs gets no rails: one agent,
UCX's own device choice.

``posting_workers = "auto"``: one per rail where there are rails, else the cores this
process may run on (``os.sched_getaffinity``), at most AUTO_MAX_WORKERS: a posting
worker is a thread copying (cma) or driving a NIC, more than the cores only contend.
A 1-core host gets one worker: the daemon's single agent, exactly as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvd.config import parse_rails, parse_workers
from kvd.transport.base import Transport
from kvd.transport.remote.workers import WorkerSet

AUTO_MAX_WORKERS = 4
_GPU_CLASSES = ("0x030000", "0x030200")  # VGA, 3D controller
_NVIDIA = "0x10de"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _common_depth(a: Path, b: Path) -> int:
    depth = 0
    for x, y in zip(a.parts, b.parts, strict=False):
        if x != y:
            break
        depth += 1
    return depth


def detect_rails(sysfs: str = "/sys") -> list[str]:
    """The NIC nearest each GPU (sysfs), in GPU order, each once; [] without GPUs or NICs.

    RDMA ports (``/sys/class/infiniband``, named ``mlx5_0:1``) when the host has any,
    else physical network interfaces."""
    root = Path(sysfs)
    gpus = []
    for dev in sorted((root / "bus/pci/devices").glob("*")):
        if _read(dev / "vendor") == _NVIDIA and _read(dev / "class") in _GPU_CLASSES:
            gpus.append(dev.resolve())
    nics = []
    # RDMA ports first, named as UCX_NET_DEVICES wants them (mlx5_0:1); Ethernet only
    # on a host without any (an IPoIB netdev would be the slow path to the same port).
    for hca in sorted((root / "class/infiniband").glob("*")):
        dev = hca / "device"
        if dev.exists():
            nics.append((f"{hca.name}:1", dev.resolve(), _read(dev / "numa_node")))
    if not nics:
        for net in sorted((root / "class/net").glob("*")):
            dev = net / "device"
            if dev.exists():  # physical (PCI) devices only: not lo, veth, bridges
                nics.append((net.name, dev.resolve(), _read(dev / "numa_node")))
    rails: list[str] = []
    for gpu in gpus:
        numa = _read(gpu / "numa_node")
        if not nics:
            break
        name = max(nics, key=lambda n: (_common_depth(gpu, n[1]), n[2] == numa))[0]
        if name not in rails:
            rails.append(name)
    return rails


def resolve(workers_setting: str, rails_setting: str, sysfs: str = "/sys",
            cores: int | None = None) -> tuple[int, list[str]]:
    """(posting workers, rails) for the config fields ``posting_workers`` and ``rails``."""
    rails = parse_rails(rails_setting)
    if rails is None:
        rails = detect_rails(sysfs)
    workers = parse_workers(workers_setting)
    if workers is None:
        if rails:
            workers = len(rails)
        else:
            cores = cores if cores is not None else len(os.sched_getaffinity(0))
            workers = max(1, min(cores, AUTO_MAX_WORKERS))
    return workers, rails


def build(make: Callable[[int, str], Transport], workers: int, rails: list[str]
          ) -> Transport:
    """The daemon's transport: ``make(index, devices)`` creates one agent.

    One worker, no rails: the single agent of old. Workers without rails: N agents,
    agent 0 the daemon's (announced at handshakes), each posting a share. Rails: agent
    0 on every rail (announced, so that peers can reach any rail of it; it keeps small
    READs and notifications), then one posting agent per worker on rail ``i % len``.
    """
    if not rails:
        if workers == 1:
            return make(0, "")
        made: list[Transport] = []
        try:
            for i in range(workers):
                made.append(make(i, ""))
        except BaseException:
            for t in made:
                t.close()
            raise
        return WorkerSet(made)
    made = []
    try:
        made.append(make(0, ",".join(rails)))
        for i in range(workers):
            made.append(make(i + 1, rails[i % len(rails)]))
    except BaseException:
        for t in made:
            t.close()
        raise
    return WorkerSet(made, rails=["", *(rails[i % len(rails)] for i in range(workers))],
                     posting=list(range(1, workers + 1)))
