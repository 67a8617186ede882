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
from kvd.transport.base import ReadPost, TransportCounts

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
        self._held_copies: dict[int, tuple] = {}
        _AGENTS[self.name] = self

    def metadata(self) -> bytes:
        return self.name.encode()

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        reg_id = next(_ids)
        self._regs[reg_id] = (addr, nbytes)
        return reg_id

    def deregister(self, reg_id: int) -> None:
        del self._regs[reg_id]

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
        xfer_id = next(_ids)
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

    def _copy(self, remote: LoopbackTransport, dsts: list[int], srcs: list[int],
              sizes: list[int], notif: bytes) -> None:
        for dst, src, n in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(dst, src, n)
        remote._inbox[self.name].append(notif)

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
        self._held_copies.pop(xfer_id, None)  # aborted: the copy never happens

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
                               peers=len(self._peers))

    def close(self) -> None:
        _AGENTS.pop(self.name, None)
