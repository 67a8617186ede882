"""While the workers park an empty step, the engine core waits for them in the kernel.

vLLM's multiprocess executor (every CPU engine; GPU engines with more than one worker
process) hands each step to its workers and takes their answers through shared-memory
queues whose readers spin (``sched_yield``) for a second after their last read
(``SpinCondition.busy_loop_s``, vLLM 0.32 and 0.33), then wait on the queue's notify
socket. A decode engine whose requests wait only for progressive pulls steps on for as
long as a whole prefill runs, each step parked by its rank-0 worker
(``kvd_progressive_idle_wait_s``): its engine core spun through every park, a whole
core taken from the prefill on a CPU host (measured: 1.0 core while waiting).

During a step the scheduler connector marked ``only_progressive`` (``quiet_for``), this
process's queue readers go straight to vLLM's own idle wait (the notify socket, woken
by the worker's answer at once, the way vLLM's readers wake after a quiet second),
until the park's end plus ``MARGIN_S``; every other step spins as vLLM does. Only the
engine-core process installs it; a vLLM without ``SpinCondition`` (or a uniprocess
executor, which has no such queues) is left as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvd.vllm")

MARGIN_S = 0.1  # past the park: a worker slow to answer (a busy host) is still waited for
_state = {"quiet_until_s": 0.0}


def quiet_for(park_s: float, now: Callable[[], float] = time.monotonic) -> None:
    """This step's workers may park up to ``park_s`` (0: they do not; spin as vLLM)."""
    _state["quiet_until_s"] = now() + park_s + MARGIN_S if park_s > 0 else 0.0


def quiet_left_s(now: Callable[[], float] = time.monotonic) -> float:
    return max(0.0, _state["quiet_until_s"] - now())


def wrap_wait(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``SpinCondition.wait`` that skips the busy loop inside a quiet window (bounded by
    the window: past it, vLLM's own wait again)."""

    def wait(self: Any, timeout_ms: int | None = None) -> Any:
        left_s = quiet_left_s()
        if left_s <= 0 or not getattr(self, "is_reader", False):
            return orig(self, timeout_ms)
        left_ms = max(1, int(left_s * 1000))
        saved = self.busy_loop_s
        self.busy_loop_s = -1.0  # vLLM's idle branch: poll the notify and cancel sockets
        try:
            return orig(self, left_ms if timeout_ms is None else min(timeout_ms, left_ms))
        finally:
            self.busy_loop_s = saved

    wait._kvd_quiet = True  # type: ignore[attr-defined]
    return wait


def install() -> bool:
    """Once per process (the engine core's); True if vLLM's readers now honour
    ``quiet_for``."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    orig = getattr(SpinCondition, "wait", None)
    if orig is None or getattr(orig, "_kvd_quiet", False):
        return orig is not None
    probe = SpinCondition.__init__.__code__.co_varnames
    if "busy_loop_s" not in probe:
        log.info("vLLM's SpinCondition has no busy_loop_s: the engine core spins while "
                 "its workers park (kvd_progressive_idle_wait_s still applies)")
        return False
    SpinCondition.wait = wrap_wait(orig)  # type: ignore[method-assign]
    return True
