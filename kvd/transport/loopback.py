"""An in-process `Transport` for fast unit tests of daemon logic.

Agents created in one process share a registry; a READ is a ctypes memmove
between registered regions, bounds-checked like NIXL does. It can be told to
fail transfers so failure paths are testable without killing processes. It is
never the only proof: integration tests use the real NIXL across processes.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import defaultdict

import numpy as np

from kvd.errors import TransferError
from kvd.transport.base import (
    DescRows,
    PostTiming,
    PreppedRead,
    ReadPost,
    TransportCounts,
    merged_count,
)

_AGENTS: dict[str, LoopbackTransport] = {}
_ids = itertools.count(1)


class LoopbackTransport:
    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"loop-{next(_ids)}"
        self._regs: dict[int, tuple[int, int]] = {}
        self._xfers: dict[int, bool] = {}
        self._peers: set[str] = set()
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self.fail_next_reads = 0
        self.hold_reads = False  # tests: READs stay in flight until this is cleared
        self.severable = True  # tests: False acts as a fabric with no connection to tear down
        self._held_copies: dict[int, tuple] = {}
        # list id -> (peer or None for local, descriptor addrs, sizes), expanded from rows
        self._prepared: dict[int, tuple[str | None, np.ndarray, np.ndarray]] = {}
        self.last_post: PostTiming | None = None
        self._merged: dict[int, int] = {}  # xfer id -> descriptors after merging
        _AGENTS[self.name] = self

    def metadata(self) -> bytes:
        return self.name.encode()

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        reg_id = next(_ids)
        self._regs[reg_id] = (addr, nbytes)
        return reg_id

    def deregister(self, reg_id: int) -> None:
        """Like NixlTransport: local prepared lists over that memory are released."""
        base, size = self._regs.pop(reg_id)
        for list_id, (peer, addrs, nbytes) in list(self._prepared.items()):
            if peer is None and ((addrs < base + size) & (addrs + nbytes > base)).any():
                del self._prepared[list_id]

    def _covers(self, addrs: np.ndarray, nbytes: np.ndarray) -> bool:
        ends = addrs + nbytes
        ok = np.zeros(len(addrs), dtype=bool)
        for base, size in self._regs.values():
            ok |= (addrs >= base) & (ends <= base + size)
        return bool(ok.all())

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        if name not in _AGENTS:
            raise TransferError(f"unknown loopback agent {name}")
        self._peers.add(name)
        return name

    def remove_peer(self, agent_name: str) -> None:
        self._peers.discard(agent_name)
        for list_id, (peer, _, _) in list(self._prepared.items()):
            if peer == agent_name:
                del self._prepared[list_id]

    def post_read(self, post: ReadPost) -> tuple[int, bool]:
        peer, notif = post.peer, post.notif
        local_addrs, remote_addrs, nbytes = post.local_addrs, post.remote_addrs, post.nbytes
        remote = _AGENTS.get(peer)
        if peer not in self._peers or remote is None:
            raise TransferError(f"peer {peer} not loaded")
        local_addrs = np.asarray(local_addrs, dtype=np.int64)
        remote_addrs = np.asarray(remote_addrs, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        if not self._covers(local_addrs, nbytes) or not remote._covers(remote_addrs, nbytes):
            raise TransferError("descriptor outside registered memory")
        return self._start(remote, local_addrs, remote_addrs, nbytes, notif, merges=False)

    def _start(self, remote: LoopbackTransport, local_addrs: np.ndarray,
               remote_addrs: np.ndarray, nbytes: np.ndarray, notif: bytes,
               merges: bool) -> tuple[int, bool]:
        """``merges``: prepared lists merge adjacent descriptors in NIXL, fresh ones don't."""
        self.last_post = PostTiming(descriptors=len(nbytes), build_s=0.0, transfer_s=0.0)
        xfer_id = next(_ids)
        self._merged[xfer_id] = (merged_count(local_addrs, remote_addrs, nbytes) if merges
                                 else len(nbytes))
        if self.fail_next_reads > 0:
            self.fail_next_reads -= 1
            self._xfers[xfer_id] = False
            return xfer_id, False
        copy = (remote, local_addrs.tolist(), remote_addrs.tolist(), nbytes.tolist(), notif)
        if self.hold_reads:  # a slow READ: it completes on a poll once hold_reads is off
            self._held_copies[xfer_id] = copy
            self._xfers[xfer_id] = True
            return xfer_id, False
        self._copy(*copy)
        self._xfers[xfer_id] = True
        return xfer_id, True

    def prepare_local(self, rows: DescRows) -> int:
        addrs, nbytes, _ = rows.expand()
        if not self._covers(addrs, nbytes):
            raise TransferError("cannot prepare local descriptors: outside registered memory")
        return self._add_prepared(None, addrs, nbytes)

    def prepare_remote(self, peer: str, rows: DescRows) -> int:
        remote = _AGENTS.get(peer)
        if peer not in self._peers or remote is None:
            raise TransferError(f"cannot prepare descriptors of {peer}: peer not loaded")
        addrs, nbytes, _ = rows.expand()
        if not remote._covers(addrs, nbytes):
            raise TransferError(f"cannot prepare descriptors of {peer}: outside its "
                                "registered memory")
        return self._add_prepared(peer, addrs, nbytes)

    def _add_prepared(self, peer: str | None, addrs: np.ndarray, nbytes: np.ndarray) -> int:
        list_id = next(_ids)
        self._prepared[list_id] = (peer, addrs, nbytes)
        return list_id

    def release_prepared(self, list_id: int) -> None:
        self._prepared.pop(list_id, None)

    def is_prepared(self, list_id: int) -> bool:
        return list_id in self._prepared

    def post_prepped_read(self, post: PreppedRead) -> tuple[int, bool]:
        """Checks what NIXL's make_prepped_xfer checks, then copies like post_read."""
        local, remote_list = self._prepared.get(post.local_list), self._prepared.get(
            post.remote_list)
        remote = _AGENTS.get(post.peer)
        if local is None or local[0] is not None:
            raise TransferError(f"READ to {post.peer}: no local prepared list {post.local_list}")
        if remote_list is None or remote_list[0] != post.peer or remote is None:
            raise TransferError(f"READ to {post.peer}: no prepared list {post.remote_list} of "
                                "that peer (released when the peer was reloaded?)")
        li = np.asarray(post.local_indices, dtype=np.int64)
        ri = np.asarray(post.remote_indices, dtype=np.int64)
        if len(li) == 0 or len(li) != len(ri):
            raise TransferError(f"READ to {post.peer}: {len(li)} local vs {len(ri)} remote "
                                "indices")
        for idx, (_, addrs, _) in ((li, local), (ri, remote_list)):
            if idx.min() < 0 or idx.max() >= len(addrs):
                raise TransferError(f"READ to {post.peer}: index out of range "
                                    f"[0, {len(addrs)})")
        nbytes = local[2][li]
        if not np.array_equal(nbytes, remote_list[2][ri]):
            raise TransferError(f"READ to {post.peer}: descriptor sizes differ pairwise")
        return self._start(remote, local[1][li], remote_list[1][ri], nbytes, post.notif,
                           merges=True)

    def _copy(self, remote: LoopbackTransport, dsts: list[int], srcs: list[int],
              sizes: list[int], notif: bytes) -> None:
        for dst, src, n in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(dst, src, n)
        remote._inbox[self.name].append(notif)

    def xfer_descriptors(self, xfer_id: int) -> int | None:
        """As NIXL would merge them (loopback copies them unmerged: same bytes)."""
        return self._merged.get(xfer_id)

    def poll(self, xfer_id: int) -> bool:
        if not self._xfers[xfer_id]:
            raise TransferError("injected transfer failure")
        if xfer_id in self._held_copies:
            if self.hold_reads:
                return False
            self._copy(*self._held_copies.pop(xfer_id))
        return True

    def release(self, xfer_id: int) -> None:
        self._xfers.pop(xfer_id, None)
        self._merged.pop(xfer_id, None)
        self._held_copies.pop(xfer_id, None)  # aborted: the copy never happens

    def sever_peer(self, agent_name: str, hosts: tuple[str, ...],
                   spare_local_ports: tuple[int, ...] = (),
                   spare_remote_ports: tuple[int, ...] = ()) -> int:
        """Held READs from that peer fail (their copies never happen), as NIXL's do once
        their connection is gone; 0 when ``severable`` is off."""
        if not self.severable:
            return 0
        severed = [x for x, copy in self._held_copies.items() if copy[0].name == agent_name]
        for xfer_id in severed:
            del self._held_copies[xfer_id]
            self._xfers[xfer_id] = False
        return 1

    def notifications(self) -> list[tuple[str, bytes]]:
        out = [(peer, m) for peer, msgs in self._inbox.items() for m in msgs]
        self._inbox.clear()
        return out

    def send_notif(self, peer: str, msg: bytes) -> None:
        remote = _AGENTS.get(peer)
        if remote is None:
            raise TransferError(f"peer {peer} gone")
        remote._inbox[self.name].append(msg)

    def counts(self) -> TransportCounts:
        return TransportCounts(registrations=len(self._regs), transfers=len(self._xfers),
                               peers=len(self._peers), prepared_lists=len(self._prepared))

    def close(self) -> None:
        _AGENTS.pop(self.name, None)
