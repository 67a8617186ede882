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
