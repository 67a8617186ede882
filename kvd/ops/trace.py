"""Where one hand-over's time goes: opt-in timestamps from the connector and the daemon.

With ``KVD_TRACE_DIR`` set, each process (connector halves, daemons) appends one line per point to
``<dir>/<pid>.trace``: ``monotonic_ns point request_id [value]``. CLOCK_MONOTONIC is one
clock for every process of a host, so the lines of the prefill's scheduler, the
decode's scheduler and its worker (three processes) and the client's own timestamps
line up (``kvd bench vllm --breakdown`` reads them). Unset (the default) every call
is one attribute check. The points:

* ``publish_sent``: the prefill's scheduler sent the publish (its request finished);
* ``decode_scheduled``: the decode's scheduler allocated blocks for a remote prefill
  (value: the scheduler's step, counted from 0: requests of one step share it);
* ``pull_sent``: the decode's scheduler sent the pull to its daemon;
* ``event_taken``: the decode's worker took the pull's done_recving (value: the
  daemon's own duration of the pull, seconds);
* ``recv_reported``: the worker handed the finished receive to vLLM;
* daemon: ``daemon_pull``, ``daemon_publish`` (the engine face took the message),
  ``daemon_acquire`` and ``daemon_acquired`` (the producer daemon's peer face took a
  consumer daemon's Acquire, and answered it there and then),
  ``daemon_event`` (an event was queued for its engine), ``daemon_event_sent`` (a poll
  reply carried it); when a pull is reported, ``daemon_phase_<transition>`` per
  transition of it (value: seconds after the daemon took it) and ``daemon_post`` per
  post (value: the post's seconds in the transport).
"""

from __future__ import annotations

import os
import threading
import time

ENV = "KVD_TRACE_DIR"
PHASE_POINT = "daemon_phase_"  # + a pull's transition (kvd.daemon.pull.consumer)


class Tracer:
    def __init__(self, directory: str | None) -> None:
        self.directory = directory or None
        self._lock = threading.Lock()
        self._file = None

    @property
    def on(self) -> bool:
        return self.directory is not None

    def point(self, name: str, request_id: str, value: float | None = None) -> None:
        if self.directory is None:
            return
        line = f"{time.monotonic_ns()} {name} {request_id}"
        if value is not None:
            line += f" {value:.6f}"
        with self._lock:
            if self._file is None:
                os.makedirs(self.directory, exist_ok=True)
                self._file = open(  # noqa: SIM115 - kept open for the process's life
                    os.path.join(self.directory, f"{os.getpid()}.trace"), "a", buffering=1)
            self._file.write(line + "\n")


TRACE = Tracer(os.environ.get(ENV))


def read_traces(directory: str) -> list[tuple[int, str, str, float | None]]:
    """Every line of every trace file in ``directory``, in time order."""
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".trace"):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    out.append((int(parts[0]), parts[1], parts[2],
                                float(parts[3]) if len(parts) > 3 else None))
    out.sort()
    return out
