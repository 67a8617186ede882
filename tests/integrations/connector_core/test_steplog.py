"""The connector's log lines leave vLLM's step: a handler that blocks does not block the
step, lines arrive in order with the caller's file and line, a full queue drops and
says so, and a forked process gets a log thread of its own."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import pytest

from kvd.integrations.connector_core.steplog import StepLog

NAME = "kvd.vllm.test-steplog"


class Blocking(logging.Handler):
    """Keeps each record; blocks in ``emit`` until ``unblock`` is set (a stderr pipe
    whose reader stalls)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.unblock = threading.Event()
        self.entered = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        self.unblock.wait(10)
        self.records.append(record)


@pytest.fixture
def handler() -> Iterator[Blocking]:
    h = Blocking()
    logger = logging.getLogger(NAME)
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        yield h
    finally:
        h.unblock.set()
        logger.removeHandler(h)
        logger.setLevel(logging.NOTSET)


def _log_in_thread(fn) -> bool:
    """Run ``fn`` on a thread; True if it returned within 2 s."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(2.0)
    return not t.is_alive()


def test_a_handler_that_blocks_does_not_block_the_step(handler: Blocking) -> None:
    log = StepLog(NAME)
    log.start()

    def step() -> None:
        log.error("request %s: first", "r1")
        log.warning("request %s: second", "r2")
        log.info("request %s: third", "r3")

    assert _log_in_thread(step), "the step waited for a blocked log handler"
    assert handler.entered.wait(2.0) and not handler.records  # held in the handler
    handler.unblock.set()
    assert log.flush(5.0)
    assert [(r.levelno, r.getMessage()) for r in handler.records] == [
        (logging.ERROR, "request r1: first"), (logging.WARNING, "request r2: second"),
        (logging.INFO, "request r3: third")]
    # the caller's line, not steplog's
    assert {r.pathname for r in handler.records} == {__file__}
    assert {r.funcName for r in handler.records} == {"step"}


def test_the_same_logger_directly_would_block(handler: Blocking) -> None:
    """The oracle for the test above: a direct log call with that handler does block."""
    logger = logging.getLogger(NAME)
    assert not _log_in_thread(lambda: logger.error("direct"))
    handler.unblock.set()


def test_lines_below_the_level_are_not_queued(handler: Blocking) -> None:
    handler.unblock.set()
    logging.getLogger(NAME).setLevel(logging.ERROR)
    log = StepLog(NAME)
    log.warning("quiet %d", 1)
    log.error("loud %d", 2)
    assert log.flush(5.0)
    assert [r.getMessage() for r in handler.records] == ["loud 2"]


def test_a_full_queue_drops_lines_and_says_how_many(handler: Blocking) -> None:
    log = StepLog(NAME, max_queued=2)
    log.start()
    log.error("line %d", 0)
    assert handler.entered.wait(2.0)  # line 0 is in the handler, the queue is empty
    for k in range(1, 6):
        log.error("line %d", k)  # 1, 2 queued; 3, 4, 5 dropped
    assert log.dropped == 3
    handler.unblock.set()
    assert log.flush(5.0)
    messages = [r.getMessage() for r in handler.records]
    assert messages[:3] == ["line 0", "line 1", "line 2"]
    assert messages[3:] == ["3 kvd log lines were dropped (more than 2 queued in the "
                            "engine's step)"]


def test_flush_says_when_a_handler_still_holds_lines(handler: Blocking) -> None:
    log = StepLog(NAME)
    log.error("held")
    assert not log.flush(0.2)
    handler.unblock.set()
    assert log.flush(5.0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_process_writes_its_own_lines(handler: Blocking, tmp_path) -> None:
    """vLLM forks its workers: the parent's log thread is not in the child, which
    starts its own at its first line."""
    handler.unblock.set()
    log = StepLog(NAME)
    log.start()
    out = tmp_path / "child.log"
    pid = os.fork()
    if pid == 0:  # the child: its own file handler, one line, then out
        code = 1
        try:
            fh = logging.FileHandler(out)
            logging.getLogger(NAME).addHandler(fh)
            log.error("from the child %d", os.getpid())
            code = 0 if log.flush(5.0) else 2
            fh.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.read_text().strip() == f"from the child {pid}"
