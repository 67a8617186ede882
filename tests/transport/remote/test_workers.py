"""Posting workers (kvd.transport.remote.workers, rails): the split, composite completion and
failure, and how many workers a config gives. Loopback agents: fast, logic only; the
byte-exact proof through real NIXL between daemons is
tests/transport/remote/test_posting_workers.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvd.errors import TransferError
from kvd.transport.base import PoolSpan, ReadPost
from kvd.transport.loopback import LoopbackTransport
from kvd.transport.remote import rails
from kvd.transport.remote.split import split_bytes
from kvd.transport.remote.workers import COMPOSITE_BASE, WorkerSet

MiB = 1 << 20


def _bytes_of(cuts: list[int]) -> list[int]:
    return [b - a for a, b in zip(cuts, cuts[1:], strict=False)]


def test_split_is_balanced_by_bytes() -> None:
    nbytes = np.array([1, 7, 2, 2, 8, 4, 4, 4] * 8, dtype=np.int64) * MiB
    addrs = np.cumsum(nbytes) * 3  # nothing adjacent: every boundary is a run boundary
    cuts = split_bytes(addrs, addrs, nbytes, 4)
    assert cuts[0] == 0 and cuts[-1] == int(nbytes.sum()) and cuts == sorted(set(cuts))
    sizes = _bytes_of(cuts)
    assert max(sizes) - min(sizes) <= 4 * MiB  # within the cut slack of a part (2 x 1 MiB)
    # Three small descriptors still give 8 parts of bytes: descriptors are no limit.
    assert len(split_bytes(addrs[:3], addrs[:3], nbytes[:3], 8)) == 9


def test_split_cuts_between_merged_runs_not_inside_them() -> None:
    """Four runs of 16 adjacent 1 MiB blocks, sizes uneven: cuts land on run boundaries
    within the slack, never inside a run that NIXL would merge into one descriptor."""
    block = MiB
    starts = [0, 100, 200, 300]
    lens = [16, 17, 15, 16]
    local = np.concatenate([(s + np.arange(n)) * block for s, n in zip(starts, lens,
                                                                       strict=True)])
    remote = local + 7 * block * 1000
    nbytes = np.full(len(local), block, dtype=np.int64)
    cuts = split_bytes(local, remote, nbytes, 4)
    assert set(cuts[1:-1]) <= {16 * MiB, 33 * MiB, 48 * MiB}, cuts
    # One contiguous run is still split (balance needs it).
    one = np.arange(64, dtype=np.int64) * block
    assert _bytes_of(split_bytes(one, one + (1 << 40), nbytes[:64], 4)) == [16 * MiB] * 4


@pytest.fixture
def workers():
    """Producer loopback agent with a patterned 64 MiB buffer; consumer WorkerSet of 3."""
    src = np.random.default_rng(5).integers(0, 256, 64 * MiB, dtype=np.uint8)
    dst = np.zeros(64 * MiB, dtype=np.uint8)
    producer = LoopbackTransport()
    producer.register(int(src.ctypes.data), src.nbytes, "DRAM", 0)
    ws = WorkerSet([LoopbackTransport() for _ in range(3)])
    ws.register(int(dst.ctypes.data), dst.nbytes, "DRAM", 0)
    peer = ws.add_peer(producer.metadata())
    yield ws, peer, src, dst
    ws.close()
    producer.close()


def _post(peer: str, src: np.ndarray, dst: np.ndarray, blocks: np.ndarray, block: int,
          pools: bool = True) -> ReadPost:
    off = blocks.astype(np.int64) * block
    return ReadPost(peer=peer, local_addrs=int(dst.ctypes.data) + off,
                    remote_addrs=int(src.ctypes.data) + off,
                    nbytes=np.full(len(blocks), block, dtype=np.int64), mem_type="DRAM",
                    notif=b"",
                    local_pools=(PoolSpan(int(dst.ctypes.data), dst.nbytes),) if pools else (),
                    remote_pools=(PoolSpan(int(src.ctypes.data), src.nbytes),) if pools else ())


def test_large_read_is_split_over_every_worker_byte_exact(workers) -> None:
    ws, peer, src, dst = workers
    blocks = np.random.default_rng(1).permutation(32)[:24]  # fragmented, 2 MiB blocks
    xfer, done = ws.post_read(_post(peer, src, dst, blocks, 2 * MiB))
    assert xfer >= COMPOSITE_BASE and done
    assert ws.poll(xfer)
    ws.release(xfer)
    for b in blocks:
        s = slice(b * 2 * MiB, (b + 1) * 2 * MiB)
        assert np.array_equal(dst[s], src[s])
    assert [s.reads for s in ws.stats] == [1, 1, 1]
    assert sum(s.nbytes for s in ws.stats) == 48 * MiB
    assert ws.counts().transfers == 0
    # each worker's part, as the pull's spans show it (one span per rail)
    parts = ws.last_post.parts
    assert [p.worker for p in parts] == [0, 1, 2]
    assert sum(p.nbytes for p in parts) == 48 * MiB
    assert sum(p.descriptors for p in parts) == ws.last_post.descriptors


def test_small_read_stays_whole_on_worker_zero(workers) -> None:
    ws, peer, src, dst = workers
    xfer, done = ws.post_read(_post(peer, src, dst, np.array([3]), 2 * MiB))
    assert xfer < COMPOSITE_BASE and done  # worker 0's own id: no wrapper
    ws.release(xfer)
    assert [s.reads for s in ws.stats] == [1, 0, 0]
    assert np.array_equal(dst[6 * MiB:8 * MiB], src[6 * MiB:8 * MiB])


def test_one_failed_worker_fails_the_read_once_all_parts_ended(workers) -> None:
    """Worker 1's part fails while worker 0's is still running: the composite stays
    PENDING (worker 0's bytes may still land, so no block may be handed back), then
    fails once worker 0's part ended."""
    ws, peer, src, dst = workers
    ws.workers[0].hold_reads = True
    ws.workers[1].fail_next_reads = 1
    xfer, done = ws.post_read(_post(peer, src, dst, np.arange(24), 2 * MiB))
    assert not done
    assert ws.poll(xfer) is False
    assert ws.poll(xfer) is False  # worker 1 failed, worker 0 pending: not ended yet
    ws.workers[0].hold_reads = False
    with pytest.raises(TransferError, match="injected"):
        ws.poll(xfer)
    ws.release(xfer)
    assert ws.counts().transfers == 0


def test_sever_ends_every_workers_part_so_no_byte_lands_after(workers) -> None:
    """The quarantine severs a stuck split READ (kvd.daemon.pull.machine): every part must
    end in failure and none of its copies may happen afterwards, on whichever worker."""
    ws, peer, src, dst = workers
    for t in ws.workers:
        t.hold_reads = True
        t.severable = True
    xfer, done = ws.post_read(_post(peer, src, dst, np.arange(24), 2 * MiB))
    assert not done and ws.poll(xfer) is False
    assert ws.sever_peer(peer, ("198.18.0.2",)) == len(ws.workers)
    for t in ws.workers:
        t.hold_reads = False
    with pytest.raises(TransferError):
        ws.poll(xfer)
    ws.release(xfer)
    assert not dst.any()  # nothing landed, on any worker
    assert ws.counts().transfers == 0


def test_a_part_that_cannot_be_posted_fails_the_read_after_the_others(workers) -> None:
    ws, peer, src, dst = workers
    third = ws._regs[next(iter(ws._regs))][2]
    ws.workers[2].deregister(third)  # worker 2 has no local memory: its part is refused
    ws.workers[0].hold_reads = True
    xfer, done = ws.post_read(_post(peer, src, dst, np.arange(24), 2 * MiB, pools=False))
    assert not done and ws.poll(xfer) is False  # worker 0's part may still land
    ws.workers[0].hold_reads = False
    with pytest.raises(TransferError, match="outside registered memory"):
        ws.poll(xfer)
    ws.release(xfer)
    # Every part failing to post: an error at once, nothing in flight.
    for t in ws.workers:
        t.remove_peer(peer)
    with pytest.raises(TransferError):
        ws.post_read(_post(peer, src, dst, np.arange(24), 2 * MiB, pools=False))
    assert ws.counts().transfers == 0


def test_a_worker_that_cannot_reach_the_peer_hands_its_part_to_worker_zero(workers) -> None:
    """A rail the peer lacks (here: the peer never loaded on worker 2): worker 0, on every
    rail, reads that part instead, byte-exact, and worker 2 sits out that peer after."""
    ws, peer, src, dst = workers
    ws.workers[2].remove_peer(peer)
    blocks = np.arange(24)
    xfer, done = ws.post_read(_post(peer, src, dst, blocks, 2 * MiB))
    assert done and ws.poll(xfer)
    ws.release(xfer)
    assert np.array_equal(dst[:48 * MiB], src[:48 * MiB])
    assert [s.reads for s in ws.stats] == [2, 1, 0]
    dst[:] = 0
    xfer, done = ws.post_read(_post(peer, src, dst, blocks, 2 * MiB))
    ws.release(xfer)
    assert [s.reads for s in ws.stats] == [3, 2, 0]  # split over workers 0 and 1 only
    assert np.array_equal(dst[:48 * MiB], src[:48 * MiB])
    # Reloading the peer gives worker 2 its chance again.
    ws.remove_peer(peer)
    ws.add_peer(peer.encode())
    xfer, _ = ws.post_read(_post(peer, src, dst, blocks, 2 * MiB))
    ws.release(xfer)
    assert [s.reads for s in ws.stats] == [4, 3, 1]


def test_auto_workers_and_rails() -> None:
    assert rails.resolve("auto", "auto", sysfs="/nonexistent", cores=1) == (1, [])
    assert rails.resolve("auto", "none", cores=2) == (2, [])
    assert rails.resolve("auto", "", cores=64) == (rails.AUTO_MAX_WORKERS, [])
    assert rails.resolve("3", "none", cores=1) == (3, [])
    assert rails.resolve("auto", "eth1,eth2", cores=8) == (2, ["eth1", "eth2"])
    made: list[LoopbackTransport] = []

    def make(i: int, devices: str) -> LoopbackTransport:
        made.append(LoopbackTransport())
        made[-1].devices = devices
        return made[-1]

    one = rails.build(make, 1, [])
    assert isinstance(one, LoopbackTransport)  # 1 worker, no rails: as before posting workers
    one.close()
    ws = rails.build(make, 2, ["eth1", "eth2"])
    assert isinstance(ws, WorkerSet)
    assert [t.devices for t in ws.workers] == ["eth1,eth2", "eth1", "eth2"]
    assert ws.posting == [1, 2] and [s.rail for s in ws.stats] == ["", "eth1", "eth2"]
    ws.close()


def test_detect_rails_picks_the_nic_nearest_each_gpu(tmp_path: Path) -> None:
    """Fake sysfs: two GPUs under two PCIe switches, a NIC under each, one elsewhere."""
    pci = tmp_path / "devices/pci0000:00"
    layout = {"gpu0": "0000:00:01.0/0000:01:00.0/0000:02:00.0",
              "nicA": "0000:00:01.0/0000:01:00.0/0000:02:01.0",
              "gpu1": "0000:00:02.0/0000:03:00.0/0000:04:00.0",
              "nicB": "0000:00:02.0/0000:03:00.0/0000:04:01.0",
              "nicC": "0000:00:03.0/0000:05:00.0"}
    for name, path in layout.items():
        d = pci / path
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n" if name.startswith("gpu") else "0x15b3\n")
        (d / "class").write_text("0x030200\n" if name.startswith("gpu") else "0x020000\n")
        (d / "numa_node").write_text("0\n")
        if name.startswith("gpu"):
            bus = tmp_path / "bus/pci/devices"
            bus.mkdir(parents=True, exist_ok=True)
            (bus / d.name).symlink_to(d)
        else:
            net = tmp_path / "class/net" / name
            net.mkdir(parents=True)
            (net / "device").symlink_to(d)
    assert rails.detect_rails(str(tmp_path)) == ["nicA", "nicB"]
    assert rails.detect_rails(str(tmp_path / "nothing")) == []
    # An RDMA port under gpu1's switch: RDMA ports win, named as UCX wants them.
    hca = tmp_path / "class/infiniband/mlx5_1"
    hca.mkdir(parents=True)
    (hca / "device").symlink_to(pci / layout["nicB"])
    assert rails.detect_rails(str(tmp_path)) == ["mlx5_1:1"]


@pytest.mark.parametrize(("field", "value"), [
    ("posting_workers", "0"), ("posting_workers", "17"), ("posting_workers", "many"),
    ("rails", "eth0,eth0"), ("rails", "eth0;rm -rf"), ("rails", ",".join(f"e{i}"
                                                                         for i in range(17))),
])
def test_bad_worker_and_rail_settings_are_refused_naming_the_field(field: str, value: str
                                                                  ) -> None:
    from kvd.config import load
    from kvd.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        load(env={f"KVD_{field.upper()}": value})
    assert load(env={"KVD_POSTING_WORKERS": "auto", "KVD_RAILS": "none"}).posting_workers == "auto"


def test_rail_counters_follow_the_workers_totals() -> None:
    from kvd.ops.metrics import Metrics

    m = Metrics()
    m.rails_seen([(0, "", 2, 100), (1, "eth1", 1, 50)])
    m.rails_seen([(0, "", 3, 160), (1, "eth1", 1, 50)])
    get = m.registry.get_sample_value
    assert get("kvd_rail_reads_total", {"worker": "0", "rail": "any"}) == 3
    assert get("kvd_rail_read_bytes_total", {"worker": "0", "rail": "any"}) == 160
    assert get("kvd_rail_read_bytes_total", {"worker": "1", "rail": "eth1"}) == 50


def test_status_lists_each_posting_worker_and_its_rail() -> None:
    from kvd.ops.status import format_status
    from kvd.wire import protocol as P

    st = P.Status(daemon_id="d", version="v", draining=False, engines=[], peers=[], held=[],
                  pulls=[], rails=[P.RailStatus(0, "", "kvd-x", 3, 3 << 20),
                                   P.RailStatus(1, "eth1", "kvd-x-w1", 2, 64 << 20)])
    text = format_status(st)
    assert "posting workers (2)" in text
    assert "eth1" in text and "kvd-x-w1" in text and "64.0 MiB" in text and "(any)" in text
    assert "posting workers" not in format_status(P.Status("d", "v", False, [], [], [], []))
