"""kvd.daemon.pull.movers: what the NIXL mover hands its data path.

A small pull's assembly keeps its descriptors as tuples of ints (no numpy on a one-block
pull's path: kvd.planner.assembly.SMALL_DESCRIPTORS); NIXL's lists are built from int64
arrays, so the NIXL mover turns every column into one before posting."""

from __future__ import annotations

import numpy as np

from kvd.daemon.pull.movers import NixlMover
from kvd.transport.base import ReadPost


class _Recorder:
    """The data path's posting calls, recorded."""

    def __init__(self) -> None:
        self.seen: list[list[ReadPost]] = []

    def can_post_now(self, posts: list[ReadPost]) -> bool:
        self.seen.append(posts)
        return True

    def post_reads_now(self, posts: list[ReadPost]) -> list:
        self.seen.append(posts)
        return []


def _post(**cols) -> ReadPost:
    base = {"local_addrs": (4096, 8192), "remote_addrs": (0, 64), "nbytes": (64, 32)}
    base.update(cols)
    return ReadPost(peer="agent", mem_type="DRAM", notif=b"", **base)


def test_tuple_columns_reach_nixl_as_int64_arrays() -> None:
    rec = _Recorder()
    mover = NixlMover(rec, peers=None, own_ports=())  # type: ignore[arg-type]
    small = _post(local_devs=(0, 0), remote_devs=(1, 1))
    assert mover.can_post_now([small])
    mover.post_now([small])
    for posts in rec.seen:
        (p,) = posts
        for name, want in (("local_addrs", [4096, 8192]), ("remote_addrs", [0, 64]),
                           ("nbytes", [64, 32]), ("local_devs", [0, 0]),
                           ("remote_devs", [1, 1])):
            col = getattr(p, name)
            assert isinstance(col, np.ndarray) and col.dtype == np.int64, name
            assert col.tolist() == want, name


def test_array_posts_pass_through_untouched() -> None:
    rec = _Recorder()
    mover = NixlMover(rec, peers=None, own_ports=())  # type: ignore[arg-type]
    arrays = _post(local_addrs=np.array([4096]), remote_addrs=np.array([0]),
                   nbytes=np.array([64]))
    mover.post_now([arrays])
    assert rec.seen[0][0] is arrays  # no copy when NIXL can take it as it is


def _block_reads():
    """A producer's reads as block ids whose descriptor columns fail if built."""
    from kvd.planner.assembly import ProducerReads
    from kvd.planner.blocks import BlockCopy, BlockTable

    table = BlockTable([1 << 20], [1 << 30], [4096], [4096], [4096], 0, 0, 64, 64)
    g = ProducerReads("agent", reads=1)
    g.blocks = BlockCopy(table, np.arange(8), np.arange(8)[::-1].copy())
    g.descriptors, g.total_nbytes = g.blocks.descriptors, g.blocks.total_nbytes

    def fill() -> None:
        raise AssertionError("descriptors built")

    g._fill = fill
    return g


def test_build_posts_hands_the_block_form_over_without_building_descriptors() -> None:
    from types import SimpleNamespace

    from kvd.daemon.pull.movers import build_posts

    g = _block_reads()
    msg = SimpleNamespace(producer_request_id="r", remote_engine_id="prod",
                          engine_id="cons")
    rank = SimpleNamespace(pool=SimpleNamespace(addr=1 << 20, nbytes=1 << 22), device_id=0)
    engine = SimpleNamespace(mem_type="VRAM", live_ranks=lambda: [rank])
    remote = SimpleNamespace(desc=SimpleNamespace(mem_type="VRAM"), ranks={}, route=None)
    posts, notices, nbytes, descriptors = build_posts(msg, engine, remote, {"agent": g})
    [post] = posts
    assert post.blocks is g.blocks
    assert (nbytes, descriptors) == (8 * 4096, 8)
    assert notices[0][1].nbytes == 8 * 4096


def test_the_assembler_asks_for_block_ids_only_from_vram_to_vram() -> None:
    from types import SimpleNamespace

    from kvd.daemon.pull.assemble import PullAssembler
    from kvd.ops.metrics import Metrics

    asked: list[bool] = []
    prepared = SimpleNamespace(assemble=lambda lo, ro, blocks=False: asked.append(blocks))
    a = PullAssembler(Metrics())
    a._prepared = lambda engine, remote: prepared
    for local, peer in (("VRAM", "VRAM"), ("DRAM", "DRAM"), ("VRAM", "DRAM"), ("DRAM", "VRAM")):
        a._assemble(SimpleNamespace(mem_type=local),
                    SimpleNamespace(desc=SimpleNamespace(mem_type=peer)), [1, 2], [3, 4])
    assert asked == [True, False, False, False]
