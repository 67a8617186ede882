"""How the rank-0 worker hears of its engine's completions: a check in the step, and a
fallback thread.

Both feed one ``EventCursor`` (acknowledged polls: the daemon keeps each event until a
later poll acknowledges it), so every done_sending / done_recving is taken exactly once
however the replies fare and whichever of the two takes it first.

``EventPump`` is the main path and needs no thread of its own to get the GIL (a vLLM
CPU worker can hold it for seconds): when vLLM binds a step's metadata it sends a
Poll that is answered at once (timeout 0) without waiting, and the step's
``get_finished`` takes the reply that came during the forward pass. A step that
computes tokens never waits: a slow, frozen or dead daemon only delays events. A step
that computes none (every request waits for its KV) parks its poll at the daemon and
waits for the reply, woken by it, for a bounded time (``kvd_idle_wait_s``), unless the
events are in the cursor already (the poller below took them first).

``EventPoller`` long-polls on a thread of its own, for the steps that do not come
(an idle engine) and a daemon that answers after the step has gone; while steps come
it stands down (``note_step``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvd.client import EventCursor, KvdClient, NoWaitClient
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.ops.trace import TRACE
from kvd.wire import protocol as P

log = logging.getLogger("kvd.vllm")

RESEND_S = 1.0  # a step poll unanswered for this long is sent again (the daemon may
# have lost it, restarting); acknowledged delivery makes a duplicate harmless


class EventPump:
    """The in-step, non-blocking check (module docstring); one worker thread uses it."""

    def __init__(self, settings: ConnectorSettings, cursor: EventCursor,
                 now: Callable[[], float],
                 client: NoWaitClient | None = None) -> None:
        self._cursor = cursor
        self._now = now
        self._client = client or NoWaitClient(settings.address, token=settings.token)

    def kick(self, park_s: float = 0.0) -> None:
        """Ask for the events now unless a poll is out already (and young). ``park_s``
        > 0: the daemon holds the poll up to that long and answers it the moment an
        event comes (for a step that will wait for it, ``drain(wait_s)``)."""
        now_s = self._now()
        sent_s = self._client.sent_s("poll")
        if sent_s is not None and now_s - sent_s < RESEND_S:
            if TRACE.on:  # value: how long the poll out has been out
                TRACE.point("worker_poll_out", "-", now_s - sent_s)
            return
        self._client.forget_older(now_s, RESEND_S)
        self._client.send(self._cursor.poll(timeout_s=park_s), "poll", now_s)
        if TRACE.on:  # value: how long the daemon may hold it
            TRACE.point("worker_poll", "-", park_s)

    def drain(self, wait_s: float = 0.0) -> int:
        """Take every reply that came; new events go into the cursor. ``wait_s`` > 0 and
        no reply yet: wait up to that long for the poll's reply (it comes the moment the
        daemon has an event). Returns the replies taken."""
        replies = self._client.replies()
        # Not when the fallback poller took events already: this step reports them at
        # its end, and its own poll (acknowledging them) has nothing more to wait for.
        if (not replies and wait_s > 0 and self._client.sent_s("poll") is not None
                and not self._cursor.has_new() and self._client.wait_reply(wait_s)):
            replies = self._client.replies()
        for reply in replies:
            self._cursor.note_instance(reply.instance)  # an Error tells a restart too
            if isinstance(reply.body, P.Events):
                self._cursor.accept(reply.body)
        if TRACE.on:  # value: the replies taken (the step's drain)
            TRACE.point("worker_drained", "-", len(replies))
        return len(replies)

    def close(self) -> None:
        self._client.close()


class EventPoller:
    """Long-polls the local kvd for one engine's events on its own thread and client.

    Why not a blocking poll inside vLLM's step: a poll to a daemon that died waits out
    the request timeout on every step, freezing the whole engine (see EventPump).
    """

    POLL_S = 1.0  # long-poll window: an idle engine asks once a second
    RETRY_S = 0.5

    def __init__(self, settings: ConnectorSettings, cursor: EventCursor,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._cursor = cursor
        self._now = now
        # the engine's last step (``note_step``); nothing is announced before the
        # first one, so the first long poll waits a window too
        self.stepped_s = now()
        self._client = KvdClient(settings.address, token=settings.token,
                                 timeout_s=settings.request_timeout_s, ping_interval_s=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvd-events-{settings.engine_id}")
        self._thread.start()

    def note_step(self, now_s: float) -> None:
        """The engine stepped: its ``EventPump`` takes the events, so this thread stands
        down until no step has come for POLL_S. Two threads woken by one reply contend
        for the GIL, and the step's may be the one that waits (a switch interval, 5 ms)."""
        self.stepped_s = now_s

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            quiet_s = self._now() - self.stepped_s
            if quiet_s < self.POLL_S:
                self._stop.wait(self.POLL_S - quiet_s)
                continue
            try:
                poll = self._cursor.poll(timeout_s=self.POLL_S)
                if TRACE.on:
                    TRACE.point("poller_poll", "-")
                events = self._client.call(poll, timeout_s=self.POLL_S + self._client.timeout_s)
                self._cursor.accept(events)
                if TRACE.on:  # value: events its reply carried
                    TRACE.point("poller_accepted", "-", len(events.events))
            except Exception as exc:  # noqa: BLE001 - keep polling whatever happened
                if self._stop.is_set():
                    return
                if not failing:
                    log.warning("polling kvd failed: %s (retrying; transfers time out if "
                                "it stays down)", exc)
                failing = True
                self._stop.wait(self.RETRY_S)
                continue
            if failing:
                log.warning("polling kvd works again")
                failing = False

    def close(self) -> None:
        self._stop.set()
        self._client.close()  # aborts a poll in flight within 0.1 s
        self._thread.join(timeout=5)
