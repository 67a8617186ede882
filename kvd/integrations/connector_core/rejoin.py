"""Registering a rank again after its daemon restarted, off vLLM's step.

When ``kvd serve`` restarts (crash, OOM kill, upgrade), or retired the engine while it
lived on (it was frozen past engine_timeout_s), the engine keeps running and
keeps its KV memory: a pool file stays (the engine's shared flock keeps the new
daemon's crash-leftover reaping off it), a memfd pool lives on in the worker's own fd
of it (handed back as ``/proc/<worker pid>/fd/<n>``), and the new daemon adopts it
(``KvdClient.adopt_rank``, docs/operations.md). This thread makes that call; the step
only kicks it (never waits) and later reads the handle it left. What was in flight on
the old daemon has already failed (``EventBook.daemon_restarted``); until the rank is
registered again the daemon refuses its publishes and pulls, so prompts are computed
locally.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from kvd.client import KvdClient, RankHandle
from kvd.errors import InvalidRequestError, KvdError

log = logging.getLogger("kvd.vllm")

RETRY_S = 1.0  # a daemon that does not answer yet (starting, frozen) is asked again
ALREADY = "already registered"  # the daemon still knows the rank: it did not restart


class Rejoin:
    """One background attempt at a time to register a rank again with adoption, on a
    thread that waits for kicks."""

    def __init__(self, client: KvdClient, get_handle: Callable[[], RankHandle | None],
                 set_handle: Callable[[RankHandle], None], what: str,
                 make_client: Callable[[], KvdClient] | None = None) -> None:
        self._client = client
        # Its own connection for the call: the rank's client may be stuck in a ping to
        # the daemon that died (up to its timeout) and serializes its calls.
        self._make_client = make_client
        self._own: KvdClient | None = None
        self._get = get_handle
        self._set = set_handle
        self._what = what
        self._stop = threading.Event()
        self._kicked = threading.Event()
        self._why = ""
        self.rejoined = 0  # successful adoptions (tests, logs)
        self.gave_up = ""  # the refusal that ended the last attempt, if any
        # Started here, outside vLLM's step: ``kick`` only sets an event.
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kvd-rejoin-{what}")
        self._thread.start()

    def kick(self, why: str) -> None:
        """Ask for an attempt; returns at once. It only sets an event: starting a thread
        here would wait, inside vLLM's step, for the new thread to run (and then for the
        GIL it took, up to the 5 ms switch interval)."""
        if not self._stop.is_set():
            self._why = why
            self._kicked.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._kicked.wait()
            if self._stop.is_set():
                return
            self._kicked.clear()  # kicks during the attempt are answered by it
            self._run(self._why)

    def _run(self, why: str) -> None:
        warned = False
        while not self._stop.is_set():
            old = self._get()
            if old is None:
                return
            try:
                if self._own is None and self._make_client is not None:
                    self._own = self._make_client()
                new = self._client.adopt_rank(old, via=self._own)
            except InvalidRequestError as exc:  # refused for good (VRAM, size, checks)
                self.gave_up = str(exc)
                log.error("%s: the restarted kvd refused to take over this engine's KV "
                          "pool (%s); prompts are computed locally until the engine "
                          "restarts", self._what, exc)
                return
            except KvdError as exc:
                if ALREADY in str(exc):
                    return  # not a restart (a frozen daemon came back): nothing to do
                if not warned:
                    log.warning("%s: registering again with kvd failed (%s; after: %s); "
                                "retrying", self._what, exc, why)
                    warned = True
                self._stop.wait(RETRY_S)
                continue
            except zmq.ZMQError:
                return  # the client was closed under us (shutdown)
            self._set(new)
            self.rejoined += 1
            if new.instance_id == old.instance_id:  # retired by a live daemon, taken back
                log.warning("%s: kvd had retired this engine (%s) and gave its pool %s "
                            "back; P/D resumes", self._what, why, new.pool.handle.name)
            else:
                log.warning("%s: registered again with kvd instance %s after %s; its pool "
                            "%s was adopted (the KV memory stayed in place)", self._what,
                            new.instance_id, why, new.pool.handle.name)
            return

    def close(self) -> None:
        self._stop.set()
        self._kicked.set()
        self._thread.join(timeout=5)
        if self._own is not None:
            self._own.close()  # it registered nothing of its own: nothing to deregister
            self._own = None
