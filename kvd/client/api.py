"""Engine API: sync and asyncio clients of the local kvd.

An engine worker registers its rank and gets its KV pool mapped (numpy, or a
torch tensor without copying); the scheduler publishes finished prefills and
pulls remote ones, then waits for done_sending / done_recving events with a
long poll. Both clients keep their registered ranks alive with pings; a
daemon that restarted answers the ping with an error, which ``on_lost`` hears.

Both clients build their messages and read their replies with the same
sans-IO core (``Messages``, ``EventStash``); only the I/O differs, so the asyncio
client offers exactly what the sync one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvd.client.core import (  # noqa: F401 - re-exported by kvd.client
    CLOSE_DEREGISTER_TIMEOUT_S,
    DEFAULT_ADDRESS,
    BlockIds,
    EventStash,
    Messages,
    RankHandle,
    default_address,
    default_curve,
    default_token,
)
from kvd.client.sockets import OwnedSockets
from kvd.errors import KvdError, KvdTimeoutError
from kvd.wire import curve as C
from kvd.wire import protocol as P

# pull_and_wait's default bound: past the daemon's default transfer_timeout_s (60 s), so
# the daemon's own verdict (a timeout is an event too) arrives first.
PULL_WAIT_TIMEOUT_S = 90.0


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _socket(ctx: zmq.Context, address: str,
            curve: tuple[C.KeyPair, bytes] | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        C.client_socket(sock, *curve)
    sock.connect(address)
    return sock


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _ClientSettings:
    """What both clients share: where the daemon is, how long to wait, how to stay alive."""

    def __init__(self, address: str | None, timeout_s: float, token: str | None,
                 ping_interval_s: float, on_lost: Callable[[str], None] | None) -> None:
        self.address = address or default_address()
        self.timeout_s = timeout_s
        self.token = default_token() if token is None else token
        # CURVE to a daemon reached off loopback (KVD_CLIENT_CURVE_*_FILE): the daemon then
        # authenticates the engine by key, and the token is not sent.
        self.curve = default_curve(self.address)
        if self.curve is not None:
            self.token = ""
        self._ids = itertools.count(1)
        self._ranks: list[RankHandle] = []
        self._ping_interval_s = ping_interval_s
        self._on_lost = on_lost
        self._stash = EventStash()

    @property
    def ranks(self) -> list[RankHandle]:
        """The ranks this client registered and has not deregistered."""
        return list(self._ranks)


class KvdClient(_ClientSettings):
    """Blocking client; safe to share between threads (calls are serialized)."""

    def __init__(self, address: str | None = None, timeout_s: float = 10.0,
                 token: str | None = None, ping_interval_s: float = 5.0,
                 on_lost: Callable[[str], None] | None = None) -> None:
        super().__init__(address, timeout_s, token, ping_interval_s, on_lost)
        self._zmq = OwnedSockets(self, zmq.Context())
        self._sock = self._zmq.add(_socket(self._zmq.ctx, self.address, self.curve))
        self._mon = self._zmq.add(self._sock.get_monitor_socket(HANDSHAKE_FAILED))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # close() writes here to end a call in flight at once: a call waits in one
        # kernel poll for its reply, the monitor's refusal and this, instead of waking
        # every 100 ms to look at a flag (each wake takes the GIL from the engine's step).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_fds = weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self._wake_fds.atexit = False
        self._poller = self._make_poller()
        self._pinger: threading.Thread | None = None

    def _make_poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        return poller

    def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            msg_id = next(self._ids)
            self._sock.send_multipart(P.encode(msg, msg_id, self.token))
            deadline = time.monotonic() + timeout_s
            while True:
                if not self._poll(deadline):
                    # The reply may still come; a fresh socket keeps later calls in step.
                    self._renew_socket()
                    raise KvdTimeoutError(f"kvd at {self.address} did not answer "
                                          f"{type(msg).__name__} within {timeout_s}s")
                header, body = P.decode(self._sock.recv_multipart(), P.REPLIES)
                if header.id == msg_id:
                    return Messages.check(body)

    def _poll(self, deadline: float) -> bool:
        """Wait for a reply until ``deadline`` in one kernel poll that also wakes for the
        monitor (a refused handshake) and for close(), so close() never waits for a call
        to a dead daemon (the pinger's) to time out: closing aborts it.

        Past the deadline the socket is still looked at once: this thread may not have
        run for a while (a starved engine worker: 30 s seen), and a reply that came
        meanwhile must be taken, not thrown away with the socket (a Poll's reply carries
        events the daemon will not send again)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                if self._sock.poll(0):
                    return True
                if left <= 0:
                    return False
                raise KvdError("client closed")
            ready = dict(self._poller.poll(max(1, math.ceil(left * 1000))))
            if self._sock in ready:
                return True
            refusal = self._refusal()
            if refusal is not None:
                self._renew_socket()
                raise refusal
            if self._stop.is_set():
                raise KvdError("client closed")

    def _refusal(self) -> KvdError | None:
        """The daemon refused the connection's security handshake (it requires CURVE and
        this client is plaintext, or it does not allow our key): say so now, instead of
        a timeout on a connection that can never carry the call."""
        while self._mon.poll(0):
            ev = parse_monitor_message(self._mon.recv_multipart())
            # Two plaintext ends never fail a handshake: any failure is a refusal.
            return C.handshake_refusal(f"kvd at {self.address}", int(ev["event"]),
                                       int(ev["value"]), self.curve is not None)
        return None

    def _renew_socket(self) -> None:
        self._sock.disable_monitor()
        self._zmq.close(self._mon)
        self._zmq.close(self._sock)
        self._sock = self._zmq.add(_socket(self._zmq.ctx, self.address, self.curve))
        self._mon = self._zmq.add(self._sock.get_monitor_socket(HANDSHAKE_FAILED))
        self._poller = self._make_poller()

    def register(self, engine_id: str, model: P.ModelSpec, layout: P.LayoutSpec, tp_rank: int = 0,
                 tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                 layer_partition: Sequence[int] | None = None,
                 engine_daemons: Sequence[str] = (), device_index: int = 0) -> RankHandle:
        """Register one rank; ``device_index`` is its GPU when the daemon runs device=cuda."""
        msg = Messages.register(engine_id, model, layout, tp_rank, tp_size, pp_rank, pp_size,
                                layer_partition, engine_daemons, device_index)
        handle = Messages.handle(msg, self.call(msg))
        self._ranks.append(handle)
        if self._pinger is None and self._ping_interval_s > 0:
            self._pinger = threading.Thread(target=self._ping_loop, daemon=True,
                                            name="kvd-client-ping")
            self._pinger.start()
        return handle

    def adopt_rank(self, old: RankHandle, via: KvdClient | None = None) -> RankHandle:
        """After this daemon restarted: register ``old``'s rank on the new incarnation,
        which takes over the pool this process still maps (shm files only; memfd and
        VRAM pools are refused with one line). The bytes never move; ``old`` is replaced
        by the returned handle (same mapping, new pool name and instance), which this
        client pings from now on. ``via``: another client to make the call on, so that
        it does not queue behind this one's ping to a daemon that died."""
        handle = Messages.adopted(old, (via or self).call(Messages.adoption(old)))
        self._ranks[:] = [handle if r is old else r for r in self._ranks]
        if handle not in self._ranks:
            self._ranks.append(handle)
        return handle

    def ping(self, handle: RankHandle | None = None) -> None:
        """Ping one rank (or every registered one) now; raises NotFoundError "not
        registered" when the daemon no longer knows it (it restarted)."""
        for r in [handle] if handle is not None else list(self._ranks):
            self.call(Messages.ping(r), timeout_s=max(self._ping_interval_s * 5, self.timeout_s))

    def _ping_loop(self) -> None:
        while not self._stop.wait(self._ping_interval_s):
            for r in list(self._ranks):
                if self._stop.is_set():
                    return
                try:
                    self.ping(r)
                except KvdError as exc:
                    if self._on_lost is not None and not self._stop.is_set():
                        self._on_lost(str(exc))
                except zmq.ZMQError:
                    return  # closed under us

    def deregister(self, handle: RankHandle, timeout_s: float | None = None) -> None:
        if handle in self._ranks:
            self._ranks.remove(handle)
        try:
            self.call(Messages.deregister(handle), timeout_s)
        finally:
            handle.pool.close()

    def publish(self, engine_id: str, request_id: str, block_ids: BlockIds,
                lease_s: float | None = None, consumers: int = 1,
                traceparent: str = "") -> str:
        """Hold the blocks for the decode engines; returns the publish receipt, for the
        router to hand to the decode side's ``pull`` (it makes the pull faster).
        ``traceparent``: the request's W3C trace context ("" none), for the hold's span."""
        reply = self.call(Messages.publish(engine_id, request_id, block_ids, lease_s,
                                           consumers, traceparent=traceparent))
        return getattr(reply, "receipt", "")

    def pull(self, engine_id: str, request_id: str, remote_engine_id: str, remote_address: str,
             remote_block_ids: BlockIds, local_block_ids: BlockIds,
             remote_request_id: str = "", num_tokens: int = -1,
             publish_receipt: str = "", traceparent: str = "") -> None:
        """Queue a pull; ``remote_request_id`` is the producer's id when it differs,
        ``num_tokens`` the prompt's token count (-1: unknown), ``publish_receipt`` what
        the producer's ``publish`` returned ("" if unknown), ``traceparent`` the
        request's W3C trace context ("" none). Hybrid engines pass one
        block-id list per KV-cache group (vLLM's ``block_ids``) on both sides."""
        self.call(Messages.pull(engine_id, request_id, remote_engine_id, remote_address,
                                remote_block_ids, local_block_ids, remote_request_id,
                                num_tokens, publish_receipt, traceparent=traceparent))

    def seal(self, engine_id: str, request_id: str, block_ids: BlockIds, num_tokens: int,
             generation: int = 0, complete: bool = False, lease_s: float | None = None,
             consumers: int = 1) -> str:
        """Progressive publish: ``block_ids`` (every block final so far, in prompt order)
        hold ``num_tokens`` final tokens; ``complete`` on the last seal; a higher
        ``generation`` unseals the earlier ones (preemption). Returns the receipt."""
        reply = self.call(Messages.seal(engine_id, request_id, block_ids, num_tokens,
                                        generation, complete, False, lease_s, consumers))
        return getattr(reply, "receipt", "")

    def abort_seal(self, engine_id: str, request_id: str) -> None:
        """The progressive request is gone: its consumers fail (and recompute)."""
        self.call(Messages.seal(engine_id, request_id, [], 0, abort=True))

    def progressive_pull(self, engine_id: str, request_id: str, remote_engine_id: str,
                         remote_address: str, local_block_ids: BlockIds, num_tokens: int,
                         remote_request_id: str = "", hold_timeout_s: float = 0.0) -> None:
        """Pull a request while its producer still computes it: each range is read once
        sealed; one done_recving event reports the whole (after the last range)."""
        self.call(Messages.progressive_pull(engine_id, request_id, remote_engine_id,
                                            remote_address, local_block_ids, num_tokens,
                                            remote_request_id, hold_timeout_s))

    def cancel_pull(self, engine_id: str, request_id: str) -> None:
        """Stop a progressive pull; its done_recving (not ok) still comes."""
        self.call(P.CancelPull(engine_id=engine_id, request_id=request_id))

    def warm_up(self, engine_id: str, producers: Sequence[tuple[str, str]]) -> None:
        """Have the daemon greet these producers ((engine id, daemon peer address) each)
        in the background, ahead of ``engine_id``'s first pulls from them."""
        self.call(Messages.warm_up(engine_id, producers))

    def pull_and_wait(self, engine_id: str, request_id: str, remote_engine_id: str,
                      remote_address: str, remote_block_ids: BlockIds,
                      local_block_ids: BlockIds, remote_request_id: str = "",
                      num_tokens: int = -1, publish_receipt: str = "",
                      timeout_s: float = PULL_WAIT_TIMEOUT_S, traceparent: str = "") -> P.Event:
        """``pull``, answered when the pull has ended with its done_recving event (one
        round trip; the event is not delivered to polls). ``timeout_s`` should outlast
        the daemon's transfer_timeout_s: an outcome that comes later is lost."""
        return Messages.pulled(self.call(
            Messages.pull(engine_id, request_id, remote_engine_id, remote_address,
                          remote_block_ids, local_block_ids, remote_request_id, num_tokens,
                          publish_receipt, reply_when_done=True, traceparent=traceparent),
            timeout_s=timeout_s))

    def poll(self, engine_id: str, timeout_s: float = 1.0) -> list[P.Event]:
        """Wait up to timeout_s for completion events of an engine (long poll)."""
        reply = self.call(Messages.poll(engine_id, timeout_s),
                          timeout_s=timeout_s + self.timeout_s)
        return list(reply.events)

    def wait(self, engine_id: str, request_id: str, kind: str, timeout_s: float = 30.0
             ) -> P.Event:
        """Block until one request's event arrives (other events are kept for later waits)."""
        deadline = time.monotonic() + timeout_s
        while (ev := self._stash.take(engine_id, request_id, kind)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvdTimeoutError(f"no {kind} for {request_id!r} within {timeout_s}s")
            self._stash.add(engine_id, self.poll(engine_id, timeout_s=min(left, 1.0)))
        return ev

    def status(self) -> P.Status:
        return self.call(P.StatusQuery())

    def close(self) -> None:
        """Deregister every rank this client registered (best effort, bounded), then close."""
        for r in list(self._ranks):
            try:
                self.deregister(r, timeout_s=CLOSE_DEREGISTER_TIMEOUT_S)
            except (KvdError, zmq.ZMQError):
                pass  # the daemon is gone or forgot the rank: nothing to free there
        self._stop.set()
        with contextlib.suppress(OSError):  # full: a wake is pending already
            os.write(self._wake_w, b"x")
        if self._pinger is not None:
            self._pinger.join(timeout=2)
        with self._lock:  # let an in-flight call finish before the socket goes
            self._sock.disable_monitor()
            self._zmq.shut()
        self._wake_fds()

    def __enter__(self) -> KvdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKvdClient(_ClientSettings):
    """asyncio client for engines that run an event loop; the sync client's twin."""

    def __init__(self, address: str | None = None, timeout_s: float = 10.0,
                 token: str | None = None, ping_interval_s: float = 5.0,
                 on_lost: Callable[[str], None] | None = None) -> None:
        super().__init__(address, timeout_s, token, ping_interval_s, on_lost)
        self._zmq = OwnedSockets(self, zmq.asyncio.Context())
        self._sock = self._zmq.add(_socket(self._zmq.ctx, self.address, self.curve))
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._pinger: asyncio.Task | None = None

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                header, body = P.decode(frames, P.REPLIES)
            except KvdError:
                continue
            fut = self._waiting.pop(header.id, None)
            if fut is not None and not fut.done():
                fut.set_result(body)

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = fut
        await self._sock.send_multipart(P.encode(msg, msg_id, self.token))
        try:
            return Messages.check(await asyncio.wait_for(
                fut, self.timeout_s if timeout_s is None else timeout_s))
        except TimeoutError:
            raise KvdTimeoutError(f"kvd at {self.address} did not answer "
                                  f"{type(msg).__name__}") from None
        finally:
            self._waiting.pop(msg_id, None)

    async def register(self, engine_id: str, model: P.ModelSpec, layout: P.LayoutSpec,
                       tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                       layer_partition: Sequence[int] | None = None,
                       engine_daemons: Sequence[str] = (), device_index: int = 0
                       ) -> RankHandle:
        msg = Messages.register(engine_id, model, layout, tp_rank, tp_size, pp_rank, pp_size,
                                layer_partition, engine_daemons, device_index)
        handle = Messages.handle(msg, await self.call(msg))
        self._ranks.append(handle)
        if self._pinger is None and self._ping_interval_s > 0:
            self._pinger = asyncio.get_running_loop().create_task(self._ping_loop())
        return handle

    async def adopt_rank(self, old: RankHandle, via: AsyncKvdClient | None = None
                         ) -> RankHandle:
        """Like ``KvdClient.adopt_rank``: the restarted daemon takes over the pool."""
        handle = Messages.adopted(old, await (via or self).call(Messages.adoption(old)))
        self._ranks[:] = [handle if r is old else r for r in self._ranks]
        if handle not in self._ranks:
            self._ranks.append(handle)
        return handle

    async def ping(self, handle: RankHandle | None = None) -> None:
        """Ping one rank (or every registered one) now, like ``KvdClient.ping``."""
        for r in [handle] if handle is not None else list(self._ranks):
            await self.call(Messages.ping(r))

    async def _ping_loop(self) -> None:
        """Keep registered ranks alive (engine_timeout_s), like the sync client's thread."""
        while True:
            await asyncio.sleep(self._ping_interval_s)
            for r in list(self._ranks):
                try:
                    await self.ping(r)
                except KvdError as exc:
                    if self._on_lost is not None:
                        self._on_lost(str(exc))

    async def deregister(self, handle: RankHandle, timeout_s: float | None = None) -> None:
        if handle in self._ranks:
            self._ranks.remove(handle)
        try:
            await self.call(Messages.deregister(handle), timeout_s)
        finally:
            handle.pool.close()

    async def publish(self, engine_id: str, request_id: str, block_ids: BlockIds,
                      lease_s: float | None = None, consumers: int = 1,
                      traceparent: str = "") -> str:
        reply = await self.call(Messages.publish(engine_id, request_id, block_ids, lease_s,
                                                 consumers, traceparent=traceparent))
        return getattr(reply, "receipt", "")

    async def pull(self, engine_id: str, request_id: str, remote_engine_id: str,
                   remote_address: str, remote_block_ids: BlockIds,
                   local_block_ids: BlockIds, remote_request_id: str = "",
                   num_tokens: int = -1, publish_receipt: str = "",
                   traceparent: str = "") -> None:
        await self.call(Messages.pull(engine_id, request_id, remote_engine_id, remote_address,
                                      remote_block_ids, local_block_ids, remote_request_id,
                                      num_tokens, publish_receipt, traceparent=traceparent))

    async def seal(self, engine_id: str, request_id: str, block_ids: BlockIds,
                   num_tokens: int, generation: int = 0, complete: bool = False,
                   lease_s: float | None = None, consumers: int = 1) -> str:
        reply = await self.call(Messages.seal(engine_id, request_id, block_ids, num_tokens,
                                              generation, complete, False, lease_s,
                                              consumers))
        return getattr(reply, "receipt", "")

    async def abort_seal(self, engine_id: str, request_id: str) -> None:
        await self.call(Messages.seal(engine_id, request_id, [], 0, abort=True))

    async def progressive_pull(self, engine_id: str, request_id: str, remote_engine_id: str,
                               remote_address: str, local_block_ids: BlockIds,
                               num_tokens: int, remote_request_id: str = "",
                               hold_timeout_s: float = 0.0) -> None:
        await self.call(Messages.progressive_pull(engine_id, request_id, remote_engine_id,
                                                  remote_address, local_block_ids,
                                                  num_tokens, remote_request_id,
                                                  hold_timeout_s))

    async def cancel_pull(self, engine_id: str, request_id: str) -> None:
        await self.call(P.CancelPull(engine_id=engine_id, request_id=request_id))

    async def warm_up(self, engine_id: str, producers: Sequence[tuple[str, str]]) -> None:
        """Like ``KvdClient.warm_up``."""
        await self.call(Messages.warm_up(engine_id, producers))

    async def pull_and_wait(self, engine_id: str, request_id: str, remote_engine_id: str,
                            remote_address: str, remote_block_ids: BlockIds,
                            local_block_ids: BlockIds, remote_request_id: str = "",
                            num_tokens: int = -1, publish_receipt: str = "",
                            timeout_s: float = PULL_WAIT_TIMEOUT_S,
                            traceparent: str = "") -> P.Event:
        return Messages.pulled(await self.call(
            Messages.pull(engine_id, request_id, remote_engine_id, remote_address,
                          remote_block_ids, local_block_ids, remote_request_id, num_tokens,
                          publish_receipt, reply_when_done=True, traceparent=traceparent),
            timeout_s=timeout_s))

    async def poll(self, engine_id: str, timeout_s: float = 1.0) -> list[P.Event]:
        reply = await self.call(Messages.poll(engine_id, timeout_s),
                                timeout_s=timeout_s + self.timeout_s)
        return list(reply.events)

    async def wait(self, engine_id: str, request_id: str, kind: str, timeout_s: float = 30.0
                   ) -> P.Event:
        """Until one request's event arrives (other events are kept for later waits)."""
        deadline = time.monotonic() + timeout_s
        while (ev := self._stash.take(engine_id, request_id, kind)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvdTimeoutError(f"no {kind} for {request_id!r} within {timeout_s}s")
            self._stash.add(engine_id, await self.poll(engine_id, timeout_s=min(left, 1.0)))
        return ev

    async def status(self) -> P.Status:
        return await self.call(P.StatusQuery())

    async def aclose(self) -> None:
        """Deregister every rank this client registered (best effort, bounded), then close."""
        for r in list(self._ranks):
            try:
                await self.deregister(r, timeout_s=CLOSE_DEREGISTER_TIMEOUT_S)
            except (KvdError, zmq.ZMQError):
                pass
        self.close()

    def close(self) -> None:
        """Close without deregistering (no event loop needed); prefer ``await aclose()``,
        or the daemon frees the ranks only after engine_timeout_s without pings."""
        if self._pinger is not None:
            self._pinger.cancel()
        for r in self._ranks:
            r.pool.close()
        self._ranks.clear()
        if self._reader is not None:
            self._reader.cancel()
        self._zmq.shut()

    async def __aenter__(self) -> AsyncKvdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
