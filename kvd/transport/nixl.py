"""`Transport` over a real NIXL agent (UCX backend).

Facts this follows (docs/../notes, measured on 2-core machines): the progress
thread busy-spins a core, so it is off by default and the daemon polls;
descriptors are passed as numpy (N, 3) arrays, never Python tuples;
`transfer()` may do the whole copy inline, so it runs on kvd's NIXL thread,
never the event loop; a dead peer surfaces as an exception from polling.
"""

from __future__ import annotations

import itertools
import logging
import uuid

import numpy as np

from kvd.errors import KvdError, TransferError
from kvd.transport.base import ReadPost, TransportCounts

log = logging.getLogger("kvd.transport")


def import_nixl():
    """The nixl Python API, from the meta package or the CUDA-12 wheel."""
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nixl_cu12 import _api  # type: ignore[import-not-found]
        except ImportError as exc:
            raise KvdError(f"NIXL is not installed ({exc}); pip install nixl-cu12") from None
    return _api


class NixlTransport:
    def __init__(self, name: str | None = None, backend: str = "UCX",
                 progress_thread: bool = False) -> None:
        api = import_nixl()
        self.name = name or f"kvd-{uuid.uuid4().hex[:12]}"
        conf = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend])
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self._agent = api.nixl_agent(self.name, conf)
        self._regs: dict[int, object] = {}
        self._xfers: dict[int, object] = {}
        self._peers: set[str] = set()
        self._ids = itertools.count(1)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        descs = self._agent.register_memory([(addr, nbytes, device_id, "")], mem_type)
        reg_id = next(self._ids)
        self._regs[reg_id] = descs
        return reg_id

    def deregister(self, reg_id: int) -> None:
        descs = self._regs.pop(reg_id)
        self._agent.deregister_memory(descs)

    def add_peer(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def remove_peer(self, agent_name: str) -> None:
        if agent_name in self._peers:
            self._peers.discard(agent_name)
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own types
                log.warning("remove_remote_agent(%s) failed: %s", agent_name, exc)

    def post_read(self, post: ReadPost) -> tuple[int, bool]:
        peer, mem_type, notif = post.peer, post.mem_type, post.notif
        n = len(post.nbytes)
        local = np.empty((n, 3), dtype=np.uint64)
        remote = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1] = post.local_addrs, post.nbytes
        remote[:, 0], remote[:, 1] = post.remote_addrs, post.nbytes
        local[:, 2] = 0 if post.local_devs is None else post.local_devs
        remote[:, 2] = 0 if post.remote_devs is None else post.remote_devs
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, mem_type),
                agent.get_xfer_descs(remote, mem_type),
                peer,
                notif,
            )
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"cannot create READ to {peer}: {exc}") from None
        xfer_id = next(self._ids)
        self._xfers[xfer_id] = handle
        try:
            state = agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001
            self.release(xfer_id)
            raise TransferError(f"READ to {peer} failed to post: {exc}") from None
        if state == "ERR":
            self.release(xfer_id)
            raise TransferError(f"READ to {peer} failed to post")
        return xfer_id, state == "DONE"

    def poll(self, xfer_id: int) -> bool:
        try:
            state = self._agent.check_xfer_state(self._xfers[xfer_id])
        except Exception as exc:  # noqa: BLE001 - nixlRemoteDisconnectError and friends
            raise TransferError(f"READ failed: {type(exc).__name__}: {exc}") from None
        if state == "ERR":
            raise TransferError("READ ended in error")
        return state == "DONE"

    def release(self, xfer_id: int) -> None:
        handle = self._xfers.pop(xfer_id, None)
        if handle is None:
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001
            log.warning("release_xfer_handle failed: %s", exc)

    def notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, msgs in self._agent.get_new_notifs().items():
            peer_name = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((peer_name, bytes(m)) for m in msgs)
        return out

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"notification to {peer} failed: {exc}") from None

    def counts(self) -> TransportCounts:
        return TransportCounts(registrations=len(self._regs), transfers=len(self._xfers),
                               peers=len(self._peers))

    def close(self) -> None:
        for xfer_id in list(self._xfers):
            self.release(xfer_id)
        for reg_id in list(self._regs):
            try:
                self.deregister(reg_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("deregister at close failed: %s", exc)
        for peer in list(self._peers):
            self.remove_peer(peer)
        self._agent = None
