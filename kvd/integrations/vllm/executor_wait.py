"""How long vLLM's queue readers spin before they sleep, in the processes the connector
runs in (the engine core and its workers).

vLLM's multiprocess executor (every CPU engine; GPU engines with more than one worker
process) hands each step to its workers and takes their answers through shared-memory
queues whose readers spin (``sched_yield``) for a second after their last read
(``SpinCondition.busy_loop_s``, vLLM 0.32 and 0.33), then wait on the queue's notify
socket, which every write pings.

Two things here change that, and nothing else:

* **A spin cap** (``cap_spin``, the connector's ``kvd_queue_spin_s``; CPU engines 5 ms by
  default): a reader spins at most that long in one wait, then sleeps until the write's
  ping. On a CPU host shared by a prefill and a decode engine, a worker that had just
  finished its step spun on for up to a second: a batch's decode step was held up to
  391 ms while the prefill's idle worker took one core for 381 ms and the decode's own
  waiting worker the other, and its engine core, which had to schedule that step, got
  19 ms of CPU (perf sched, docs/notes/2026-12-07-queue-spin.md). Steps that come back
  to back (the next one a millisecond or two after the last answer) are still caught
  spinning.
* **Quiet windows** (``quiet_for``): a decode engine whose requests wait only for
  progressive pulls steps on for as long as a whole prefill runs, each step parked by
  its rank-0 worker (``kvd_progressive_idle_wait_s``); during such a step the engine
  core does not spin at all (measured before: 1.0 core while waiting), until the park's
  end plus ``MARGIN_S``.

A vLLM without ``SpinCondition`` (or a uniprocess executor, which has no such queues)
is left as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvd.vllm")

MARGIN_S = 0.1  # past the park: a worker slow to answer (a busy host) is still waited for
_state: dict[str, float | None] = {"quiet_until_s": 0.0, "spin_s": None}


def quiet_for(park_s: float, now: Callable[[], float] = time.monotonic) -> None:
    """This step's workers may park up to ``park_s`` (0: they do not; spin as vLLM)."""
    _state["quiet_until_s"] = now() + park_s + MARGIN_S if park_s > 0 else 0.0


def quiet_left_s(now: Callable[[], float] = time.monotonic) -> float:
    return max(0.0, (_state["quiet_until_s"] or 0.0) - now())


def cap_spin(spin_s: float | None) -> None:
    """This process's readers spin at most ``spin_s`` per wait (None: vLLM's own)."""
    _state["spin_s"] = spin_s


def wrap_wait(orig: Callable[..., Any],
              now: Callable[[], float] = time.monotonic) -> Callable[..., Any]:
    """``SpinCondition.wait`` that spins only while vLLM would and the cap allows, and
    not at all inside a quiet window (bounded by the window: past it, vLLM's own wait
    again). One wait is the calls between two reads (vLLM's reader calls ``wait`` in a
    loop until its message is there)."""

    def wait(self: Any, timeout_ms: int | None = None) -> Any:
        if not getattr(self, "is_reader", False):
            return orig(self, timeout_ms)
        t = now()
        if getattr(self, "_kvd_read", None) != self.last_read:  # a new wait
            self._kvd_read, self._kvd_since = self.last_read, t
        spin_s = _state["spin_s"]
        left_s = quiet_left_s(lambda: t)
        if left_s <= 0 and (spin_s is None or t - self._kvd_since < spin_s):
            return orig(self, timeout_ms)  # vLLM's own: spins within its busy loop
        if left_s > 0:
            left_ms = max(1, int(left_s * 1000))
            timeout_ms = left_ms if timeout_ms is None else min(timeout_ms, left_ms)
        saved = self.busy_loop_s
        self.busy_loop_s = -1.0  # vLLM's idle branch: poll the notify and cancel sockets
        try:
            return orig(self, timeout_ms)
        finally:
            self.busy_loop_s = saved

    wait._kvd_quiet = True  # type: ignore[attr-defined]
    return wait


def install() -> bool:
    """Once per process (the engine core's and each worker's: idempotent); True if
    vLLM's readers now honour ``quiet_for`` and ``cap_spin``."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    orig = getattr(SpinCondition, "wait", None)
    if orig is None or getattr(orig, "_kvd_quiet", False):
        return orig is not None
    probe = SpinCondition.__init__.__code__.co_varnames
    if "busy_loop_s" not in probe:
        log.info("vLLM's SpinCondition has no busy_loop_s: its queue readers spin as vLLM "
                 "has them (kvd_queue_spin_s has no effect; kvd_progressive_idle_wait_s "
                 "still applies)")
        return False
    SpinCondition.wait = wrap_wait(orig)  # type: ignore[method-assign]
    return True
