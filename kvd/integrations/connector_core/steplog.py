"""Log lines written inside vLLM's step leave it on a thread of their own.

A logging handler does I/O: stderr, a file, a pipe a supervisor reads, whatever handler
the user configured. That costs milliseconds now and then (a record formatted on a
loaded host took 2.4 ms of the step's own CPU in the hook-latency test), and a
stderr pipe whose reader stalls blocks the writer outright. Inside the engine's step the
connector only builds the record (the caller's file and line, the message's args kept
as they are) and queues it; one daemon thread per process hands each record, in order,
to the ``kvd.vllm`` logger, whose level, filters, handlers and propagation then apply
as for any other line. Lines written outside the step (registration, start-up, the
connector's own threads) use the logger directly.

The queue is bounded (``MAX_QUEUED``): past it a line is dropped and counted, and the
thread says how many once it catches up. ``flush`` waits for what is queued (tests,
and at interpreter exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading

MAX_QUEUED = 10_000  # records waiting for the log thread; past it lines are dropped
LOGGER = "kvd.vllm"


class StepLog:
    """``warning``/``error``/``info`` as on a logger, queued for the log thread."""

    def __init__(self, name: str = LOGGER, max_queued: int = MAX_QUEUED) -> None:
        self.logger = logging.getLogger(name)
        self._queue: queue.Queue[logging.LogRecord | None] = queue.Queue(max_queued)
        self._lock = threading.Lock()
        self._pid = -1  # the process whose thread drains the queue (a fork has none)
        self.dropped = 0  # lines lost to a full queue, not yet reported

    def start(self) -> None:
        """Start this process's log thread unless it runs. The connector calls it when it
        is built, outside the step; a line queued before then starts it."""
        with self._lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._queue = queue.Queue(self._queue.maxsize)  # a fork's copy: nobody drains it
            threading.Thread(target=self._run, args=(self._queue,), daemon=True,
                             name="kvd-steplog").start()

    def info(self, msg: str, *args: object) -> None:
        self._put(logging.INFO, msg, args)

    def warning(self, msg: str, *args: object) -> None:
        self._put(logging.WARNING, msg, args)

    def error(self, msg: str, *args: object) -> None:
        self._put(logging.ERROR, msg, args)

    def _put(self, level: int, msg: str, args: tuple[object, ...]) -> None:
        if not self.logger.isEnabledFor(level):
            return
        if self._pid != os.getpid():
            self.start()
        caller = sys._getframe(2)  # the connector's line that logs, past warning() etc.
        code = caller.f_code
        record = self.logger.makeRecord(self.logger.name, level, code.co_filename,
                                        caller.f_lineno, msg, args, None, code.co_name)
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _run(self, q: queue.Queue[logging.LogRecord | None]) -> None:
        while True:
            record = q.get()
            try:
                if record is not None:
                    self.logger.handle(record)
                if self.dropped and q.empty():
                    n, self.dropped = self.dropped, 0
                    self.logger.warning("%d kvd log lines were dropped (more than %d "
                                        "queued in the engine's step)", n, q.maxsize)
            except Exception:  # noqa: BLE001 - a handler's failure must not end the thread
                pass
            finally:
                q.task_done()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait up to ``timeout_s`` until every line queued so far has been handed to
        the logger; False if some are still queued (a handler that blocks)."""
        if self._pid != os.getpid():
            return True
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout_s)


step_log = StepLog()
atexit.register(step_log.flush)
