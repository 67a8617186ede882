"""`Transport` over a real NIXL agent (UCX backend).

Facts this follows (docs/../notes, measured on 2-core machines): the progress
thread busy-spins a core, so it is off by default and the daemon polls;
descriptors are passed as numpy arrays, never Python tuples (strided (N, 5)
rows for prepared lists, (N, 3) for fresh ones), and indices as int32 arrays;
`transfer()` may do the whole copy inline, so it runs on kvd's NIXL thread,
never the event loop; a dead peer surfaces as an exception from polling.

Every NIXL exception is turned into a `TransferError` in one place
(`_nixl_call`), so the daemon sees one error type naming the NIXL error.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvd.errors import KvdError, TransferError
from kvd.transport.base import DescRows, PostTiming, PreppedRead, ReadPost, TransportCounts
from kvd.transport.remote import sockets
from kvd.transport.remote.ucx_heap import zero_fresh_heap

log = logging.getLogger("kvd.transport")

INIT_AGENT = "NIXL_INIT_AGENT"  # prep_xfer_dlist's name for "this agent, local side"


def import_nixl():
    """The nixl Python API: the meta package, or the CUDA-12 or CUDA-13 wheel (a GPU
    node with a CUDA 13 driver stack installs nixl-cu13 and nothing else)."""
    errors = []
    for package in ("nixl", "nixl_cu12", "nixl_cu13"):
        try:
            return importlib.import_module(f"{package}._api")
        except ImportError as exc:
            errors.append(f"{package}: {exc}")
    raise KvdError(f"NIXL is not installed ({'; '.join(errors)}); "
                   "pip install nixl-cu12 (or nixl-cu13)")


@contextmanager
def _nixl_call(what: str) -> Iterator[None]:
    """The one place NIXL's exceptions (nixlRemoteDisconnectError, nixlNotFoundError,
    nixlInvalidParamError, ...) become kvd's TransferError, named for the caller."""
    try:
        yield
    except TransferError:
        raise
    except Exception as exc:  # noqa: BLE001 - NIXL raises its own types, all alike to us
        raise TransferError(f"{what}: {type(exc).__name__}: {exc}") from None


def _indices(values: np.ndarray) -> np.ndarray:
    """int32, contiguous: what make_prepped_xfer takes without converting element-wise."""
    return np.ascontiguousarray(values, dtype=np.int32)


@dataclass
class _Prepared:
    handle: object
    peer: str | None  # None: local side
    size: int  # descriptors
    extent: tuple[int, int]  # [low, high) addresses, to drop lists over deregistered memory


def ucx_liveness_env(timeout_s: float, env: dict[str, str] | None = None) -> dict[str, str]:
    """UCX TCP keepalive settings that fail a connection to a silent peer in ~timeout_s.

    Why: across a partition UCX's TCP connections stay ESTABLISHED and a READ posted
    before the cut resumes when the link comes back, writing into memory kvd may have
    handed back. Only the transport failing the endpoint (its requests completed with
    an error, its sockets closed) makes that impossible; NIXL 1.5's remove_remote_agent
    does not (UCP endpoints close without UCP_EP_CLOSE_FLAG_FORCE). The READer side of
    a TCP-emulated READ mostly has no unacknowledged data, so keepalive probes detect
    the silence: idle + interval * count seconds (Linux counts whole seconds). When the
    cut catches its own GET requests unacknowledged, keepalive never probes and only
    TCP_USER_TIMEOUT ends the connection (else retransmissions go on ~15 minutes):
    measured in tests/daemon/pull/test_partition.py. Variables already set (an
    operator's tuning, e.g. for RDMA fabrics) are kept.
    """
    env = os.environ if env is None else env
    step_s = max(1, round(timeout_s / 3))
    wanted = {"UCX_TCP_KEEPIDLE": f"{step_s}s", "UCX_TCP_KEEPINTVL": f"{step_s}s",
              "UCX_TCP_KEEPCNT": "2", "UCX_TCP_USER_TIMEOUT": f"{3 * step_s}s"}
    set_now = {k: v for k, v in wanted.items() if k not in env}
    env.update(set_now)
    return set_now


@contextmanager
def _net_devices(devices: str) -> Iterator[None]:
    """UCX_NET_DEVICES=devices while an agent is created: UCX reads its configuration
    once, when NIXL creates the backend's UCP context, so each agent keeps its own.
    (NIXL 1.5's ``ucx_devices`` backend parameter is listed but did not restrict the
    devices, measured with two veth rails: tests/transport/remote/test_rails.py.) Agents are
    created on the daemon's NIXL thread at start, before any other UCX use."""
    if not devices:
        yield
        return
    old = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = devices
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_NET_DEVICES", None)
        else:
            os.environ["UCX_NET_DEVICES"] = old


class NixlTransport:
    def __init__(self, name: str | None = None, backend: str = "UCX",
                 progress_thread: bool = False, telemetry: bool = False,
                 liveness_timeout_s: float | None = None, devices: str = "") -> None:
        """``telemetry``: NIXL records per-transfer figures, among them the descriptor
        count after merging (``xfer_descriptors``); off by default.
        ``liveness_timeout_s``: see `ucx_liveness_env` (None: UCX's defaults).
        ``devices``: the network devices this agent's UCX may use, comma-separated
        (UCX_NET_DEVICES for this agent alone: one rail per posting worker,
        kvd.transport.remote.workers); "" for UCX's choice (or the process's UCX_NET_DEVICES)."""
        if liveness_timeout_s is not None:
            ucx_liveness_env(liveness_timeout_s)  # read by UCX when the agent is created
        zero_fresh_heap()  # before UCX's request pool grows: kvd.transport.remote.ucx_heap
        api = import_nixl()
        self.name = name or f"kvd-{uuid.uuid4().hex[:12]}"
        self._telemetry = telemetry
        conf = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend],
                                     capture_telemetry=telemetry)
        logging.getLogger("nixl").setLevel(logging.WARNING)
        with _net_devices(devices):
            self._agent = api.nixl_agent(self.name, conf)
        self._regs: dict[int, tuple[object, int, int]] = {}  # id -> (descs, addr, nbytes)
        self._xfers: dict[int, object] = {}
        self._peers: set[str] = set()
        self._prepared: dict[int, _Prepared] = {}
        self._ids = itertools.count(1)
        self.last_post: PostTiming | None = None

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        with _nixl_call(f"cannot register {nbytes} bytes of {mem_type}"):
            descs = self._agent.register_memory([(addr, nbytes, device_id, "")], mem_type)
        reg_id = next(self._ids)
        self._regs[reg_id] = (descs, addr, nbytes)
        return reg_id

    def deregister(self, reg_id: int) -> None:
        """Also releases local prepared lists over that memory (they would dangle)."""
        descs, addr, nbytes = self._regs.pop(reg_id)
        for list_id, p in list(self._prepared.items()):
            if p.peer is None and p.extent[0] < addr + nbytes and addr < p.extent[1]:
                self.release_prepared(list_id)
        with _nixl_call("deregister_memory"):
            self._agent.deregister_memory(descs)

    def add_peer(self, metadata: bytes) -> str:
        with _nixl_call("cannot load peer metadata"):
            name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        # Connect now, at the handshake (on the NIXL thread), not inside the first READ:
        # that one pays the connection set-up otherwise (10-15 ms, and it must not sit
        # on a pull's path). Optional for NIXL: a backend that cannot still connects on
        # first use.
        try:
            with _nixl_call(f"make_connection({name})"):
                self._agent.make_connection(name)
        except TransferError as exc:
            log.debug("no early connection to %s: %s", name, exc)
        return name

    def remove_peer(self, agent_name: str) -> None:
        """Also releases the lists prepared over that peer's memory."""
        for list_id, p in list(self._prepared.items()):
            if p.peer == agent_name:
                self.release_prepared(list_id)
        if agent_name in self._peers:
            self._peers.discard(agent_name)
            try:
                with _nixl_call(f"remove_remote_agent({agent_name})"):
                    self._agent.remove_remote_agent(agent_name)
            except TransferError as exc:
                log.warning("%s", exc)

    def sever_peer(self, agent_name: str, hosts: tuple[str, ...],
                   spare_local_ports: tuple[int, ...] = (),
                   spare_remote_ports: tuple[int, ...] = ()) -> int:
        """Abort the UCX TCP connections to the peer's hosts (kvd.transport.remote.sockets): its
        READs then fail at their next progress and cannot land. NIXL 1.5 offers no
        forced endpoint close (``ucx_ep_close_force`` came later), so this works under
        NIXL, on the sockets; 0 when none was found (RDMA: nothing to abort)."""
        shut = sockets.shut_connections_to(hosts, spare_local_ports, spare_remote_ports)
        log.warning("severed %d transport connections to %s (%s)", shut, agent_name,
                    ", ".join(hosts))
        return shut

    # ------------------------------------------------------------- posting

    def _post(self, handle: object, peer: str, ndesc: int, t0: float, t1: float
              ) -> tuple[int, bool]:
        xfer_id = next(self._ids)
        self._xfers[xfer_id] = handle
        try:
            with _nixl_call(f"READ to {peer} failed to post"):
                state = self._agent.transfer(handle)
        except TransferError:
            self.release(xfer_id)
            raise
        t2 = time.perf_counter()
        if state == "ERR":
            self.release(xfer_id)
            raise TransferError(f"READ to {peer} failed to post")
        self.last_post = PostTiming(descriptors=ndesc, build_s=t1 - t0, transfer_s=t2 - t1)
        return xfer_id, state == "DONE"

    def post_read(self, post: ReadPost) -> tuple[int, bool]:
        t0 = time.perf_counter()
        peer, mem_type, notif = post.peer, post.mem_type, post.notif
        n = len(post.nbytes)
        local = np.empty((n, 3), dtype=np.uint64)
        remote = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1] = post.local_addrs, post.nbytes
        remote[:, 0], remote[:, 1] = post.remote_addrs, post.nbytes
        local[:, 2] = 0 if post.local_devs is None else post.local_devs
        remote[:, 2] = 0 if post.remote_devs is None else post.remote_devs
        agent = self._agent
        with _nixl_call(f"cannot create READ to {peer}"):
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, post.local_mem_type or mem_type),
                agent.get_xfer_descs(remote, mem_type),
                peer,
                notif,
            )
        return self._post(handle, peer, n, t0, time.perf_counter())

    def prepare_local(self, rows: DescRows) -> int:
        with _nixl_call(f"cannot prepare {len(rows)} local descriptors"):
            handle = self._agent.prep_xfer_dlist(INIT_AGENT, rows.nixl_rows(), rows.mem_type)
        return self._add_prepared(handle, None, rows)

    def prepare_remote(self, peer: str, rows: DescRows) -> int:
        if peer not in self._peers:
            raise TransferError(f"cannot prepare descriptors of {peer}: peer not loaded")
        with _nixl_call(f"cannot prepare {len(rows)} descriptors of {peer}"):
            handle = self._agent.prep_xfer_dlist(peer, rows.nixl_rows(), rows.mem_type)
        return self._add_prepared(handle, peer, rows)

    def _add_prepared(self, handle: object, peer: str | None, rows: DescRows) -> int:
        list_id = next(self._ids)
        self._prepared[list_id] = _Prepared(handle, peer, len(rows), rows.extent())
        return list_id

    def release_prepared(self, list_id: int) -> None:
        p = self._prepared.pop(list_id, None)
        if p is None:
            return
        try:
            with _nixl_call("release_dlist_handle"):
                self._agent.release_dlist_handle(p.handle)
        except TransferError as exc:
            log.warning("%s", exc)

    def is_prepared(self, list_id: int) -> bool:
        return list_id in self._prepared

    def post_prepped_read(self, post: PreppedRead) -> tuple[int, bool]:
        t0 = time.perf_counter()
        local, remote = self._prepared.get(post.local_list), self._prepared.get(post.remote_list)
        if local is None or local.peer is not None:
            raise TransferError(f"READ to {post.peer}: no local prepared list {post.local_list}")
        if remote is None or remote.peer != post.peer:
            raise TransferError(f"READ to {post.peer}: no prepared list {post.remote_list} of "
                                "that peer (released when the peer was reloaded?)")
        with _nixl_call(f"cannot create READ to {post.peer}"):
            handle = self._agent.make_prepped_xfer(
                "READ", local.handle, _indices(post.local_indices),
                remote.handle, _indices(post.remote_indices), post.notif)
        return self._post(handle, post.peer, len(post.local_indices), t0, time.perf_counter())

    # ------------------------------------------------------------- progress

    def xfer_descriptors(self, xfer_id: int) -> int | None:
        if not self._telemetry:
            return None
        handle = self._xfers[xfer_id]
        with _nixl_call("get_xfer_telemetry"):
            return int(self._agent.get_xfer_telemetry(handle).descCount)

    def poll(self, xfer_id: int) -> bool:
        handle = self._xfers[xfer_id]
        with _nixl_call("READ failed"):  # nixlRemoteDisconnectError when the peer died
            state = self._agent.check_xfer_state(handle)
        if state == "ERR":
            raise TransferError("READ ended in error")
        return state == "DONE"

    def release(self, xfer_id: int) -> None:
        handle = self._xfers.pop(xfer_id, None)
        if handle is None:
            return
        try:
            with _nixl_call("release_xfer_handle"):
                self._agent.release_xfer_handle(handle)
        except TransferError as exc:
            log.warning("%s", exc)

    def notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        with _nixl_call("get_new_notifs"):
            notifs = self._agent.get_new_notifs()
        for peer, msgs in notifs.items():
            peer_name = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((peer_name, bytes(m)) for m in msgs)
        return out

    def send_notif(self, peer: str, msg: bytes) -> None:
        with _nixl_call(f"notification to {peer} failed"):
            self._agent.send_notif(peer, msg)

    def counts(self) -> TransportCounts:
        return TransportCounts(registrations=len(self._regs), transfers=len(self._xfers),
                               peers=len(self._peers), prepared_lists=len(self._prepared))

    def close(self) -> None:
        for xfer_id in list(self._xfers):
            self.release(xfer_id)
        for list_id in list(self._prepared):
            self.release_prepared(list_id)
        for reg_id in list(self._regs):
            try:
                self.deregister(reg_id)
            except TransferError as exc:
                log.warning("deregister at close failed: %s", exc)
        for peer in list(self._peers):
            self.remove_peer(peer)
        self._agent = None
