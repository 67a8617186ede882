"""Faults mid local VRAM copy (both engines on one ``kvd serve --device cuda``): an engine
deregistering, the daemon frozen, the daemon killed. The DRAM guarantees hold on the GPU
(tests/daemon/pull/test_local_pull_faults.py): the hold is released only after the
copy's CUDA event, memory handed back is never written afterwards, a frozen copy ends
after the thaw with the right bytes. Also: the copier's kernels are compiled at start-up,
before any pull, and the time is logged. Skips without a CUDA GPU."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from typing import Any

import pytest
from support.cluster import deregister_and_check_freed, metric, register, unique, wait_until

from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec


def _gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine: local VRAM "
                                 "faults untested here")]

BIG = ModelSpec(name="vram-big", num_kv_heads=8, num_layers=32, head_dim=128)  # 2 MiB/block
BLOCKS = 512  # 1 GiB a pool: the copy takes milliseconds, not microseconds


def _bits(t: Any) -> Any:
    """A bf16 (or any 2-byte) tensor's bits: the pools hold arbitrary bit patterns, NaNs
    among them, and NaN != NaN (torch.equal on the floats failed on a correct copy)."""
    import torch

    return t.view(torch.int16)


def _t(kv: Any) -> Any:
    import torch

    t = torch.from_numpy(kv) if not isinstance(kv, torch.Tensor) else kv
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return t


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess.start(unique("itvram"), tmp_path_factory.mktemp("kvd-logs"),
                            extra_args=["--device", "cuda"])
    c = d.client(timeout_s=60)
    try:
        yield d, c
    finally:
        c.close()
        rc = d.stop()
        leftovers = kvd_segments(f"kvd-{d.name}")
        assert rc == 0 and not leftovers, (rc, leftovers)


def _big_pair(c, blocks: int = BLOCKS):
    import torch

    shape = EngineShape(tp_size=1, num_blocks=blocks)
    p = register(c, "bigp", BIG, shape)
    dd = register(c, "bigd", BIG, shape)
    kv = _t(p.ranks[0].kv)
    assert kv.is_cuda, "a --device cuda daemon gave a host pool"
    words = kv.reshape(-1).view(torch.int64)
    words.copy_(torch.arange(words.numel(), dtype=torch.int64, device=kv.device))
    _t(kv)  # synchronised
    rng = random.Random(7)
    return shape, p, dd, rng.sample(range(blocks), blocks), rng.sample(range(blocks), blocks)


def _zeros_stay(c, n: int = 3) -> list:
    """Engines registered right after memory was handed back (the allocator may give
    them that very memory): zeroed, then checked still all zeros a moment later."""
    import torch

    fresh = [register(c, "fresh", BIG, EngineShape(tp_size=1, num_blocks=BLOCKS))
             for _ in range(n)]
    for e in fresh:
        _t(e.ranks[0].kv).zero_()
    time.sleep(0.5)
    for e in fresh:
        kv = _t(e.ranks[0].kv).reshape(-1).view(torch.uint8)
        assert int(torch.count_nonzero(kv)) == 0, "memory handed back was written"
    return fresh


def test_kernels_are_compiled_at_start_up_and_the_time_logged(one) -> None:
    d, _ = one
    line = wait_until(lambda: re.search(r"CUDA copy kernels ready on GPU 0: compiled in "
                                        r"([0-9.]+) s", d.log_path.read_text()),
                      timeout_s=60, what="the kernels' compile to be logged")
    assert float(line.group(1)) > 0
    assert metric(d, "kvd_transfers_total", role="consumer") == 0  # before any pull


@pytest.mark.parametrize("leaving", ["consumer", "producer"])
def test_an_engine_leaving_mid_vram_copy_loses_nothing(one, leaving) -> None:
    """A 1 GiB local VRAM pull; right after the daemon accepted it, one engine
    deregisters. The other engine hears a clean outcome (the right bytes, or every block
    invalid), the pools are freed, and memory handed back is not written afterwards."""
    import torch

    d, c = one
    shape, p, dd, p_ids, d_ids = _big_pair(c)
    rid = unique("leave")
    expected = _t(p.ranks[0].kv)[:, :, p_ids].clone()
    c.publish(p.engine_id, rid, p_ids)
    c.pull(dd.engine_id, rid, p.engine_id, d.peer_address, p_ids, d_ids)
    leaver, stayer = (dd, p) if leaving == "consumer" else (p, dd)
    for r in leaver.ranks:
        c.deregister(r)
    fresh = _zeros_stay(c)
    if leaving == "consumer":
        sent = c.wait(p.engine_id, rid, "done_sending", timeout_s=30)
        assert sent.ok or sent.error, sent
    else:
        recv = c.wait(dd.engine_id, rid, "done_recving", timeout_s=30)
        if recv.ok:
            assert torch.equal(_bits(_t(dd.ranks[0].kv)[:, :, d_ids]), _bits(expected))
        else:
            assert recv.invalid_block_ids == d_ids and recv.nbytes == 0
    deregister_and_check_freed(c, stayer, *fresh)
    deadline = time.monotonic() + 10
    while c.status().engines and time.monotonic() < deadline:
        time.sleep(0.05)
    st = c.status()
    assert st.engines == [] and st.pulls == [] and st.held == []


def test_a_frozen_daemon_finishes_its_local_vram_copy_after_the_thaw(one) -> None:
    import torch

    d, c = one
    shape, p, dd, p_ids, d_ids = _big_pair(c)
    rid = unique("freeze")
    expired0 = metric(d, "kvd_leases_expired_total")
    c.publish(p.engine_id, rid, p_ids, lease_s=1.0)
    c.pull(dd.engine_id, rid, p.engine_id, d.peer_address, p_ids, d_ids)
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(5.0)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    recv = c.wait(dd.engine_id, rid, "done_recving", timeout_s=30)
    assert recv.ok, recv.error
    assert torch.equal(_bits(_t(dd.ranks[0].kv)[:, :, d_ids]),
                       _bits(_t(p.ranks[0].kv)[:, :, p_ids]))
    assert c.wait(p.engine_id, rid, "done_sending", timeout_s=10).ok
    assert metric(d, "kvd_leases_expired_total") == expired0
    deregister_and_check_freed(c, p, dd)


def test_a_daemon_killed_mid_vram_copy_fails_the_wait_and_a_new_one_works(tmp_path) -> None:
    """SIGKILL right after a 1 GiB local VRAM pull was accepted: the engine's wait fails
    in bounded time instead of hanging, and a new daemon on the same GPU pulls
    byte-exact (the driver took the dead one's context, copies and memory with it).
    The GPU's free memory before, at the kill and after is printed, not judged: this
    process still maps the dead daemon's pools until it lets go of them."""
    import torch

    free = [torch.cuda.mem_get_info(0)[0]]
    d = DaemonProcess.start(unique("itkill"), tmp_path, extra_args=["--device", "cuda"])
    c = d.client(timeout_s=5)
    try:
        _, p, dd, p_ids, d_ids = _big_pair(c)
        rid = unique("kill")
        c.publish(p.engine_id, rid, p_ids)
        c.pull(dd.engine_id, rid, p.engine_id, d.peer_address, p_ids, d_ids)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(timeout=30)
        free.append(torch.cuda.mem_get_info(0)[0])
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017, PT011 - a timeout or a lost connection
            c.wait(dd.engine_id, rid, "done_recving", timeout_s=5)
        assert time.monotonic() - t0 < 20
    finally:
        c.close()
        if d.proc.poll() is None:
            d.stop()
        for name in kvd_segments(f"kvd-{d.name}"):
            (SHM_DIR / name).unlink(missing_ok=True)
    again = DaemonProcess.start(unique("itkill2"), tmp_path, extra_args=["--device", "cuda"])
    c2 = again.client(timeout_s=60)
    try:
        _, p, dd, p_ids, d_ids = _big_pair(c2, blocks=64)
        rid = unique("after")
        c2.publish(p.engine_id, rid, p_ids)
        c2.pull(dd.engine_id, rid, p.engine_id, again.peer_address, p_ids, d_ids)
        assert c2.wait(dd.engine_id, rid, "done_recving", timeout_s=30).ok
        assert torch.equal(_bits(_t(dd.ranks[0].kv)[:, :, d_ids]),
                       _bits(_t(p.ranks[0].kv)[:, :, p_ids]))
        deregister_and_check_freed(c2, p, dd)
    finally:
        c2.close()
        assert again.stop() == 0
    free.append(torch.cuda.mem_get_info(0)[0])
    print("GPU free MiB before / at the kill / after:", [f >> 20 for f in free])
