"""Logging for the ``kvd`` logger tree: text or JSON lines, repeated warnings rate-limited.

One failure is one line that carries its context (request, engine, peer) as
structured fields, so an operator can grep or query by request id. A peer that
dies under load makes the same warning fire per request; the rate limiter keeps
the first few and then says how many were dropped, so a log pipeline never
chokes on a storm of identical lines.

Context goes through ``extra``::

    log.warning("pull failed: %s", err, extra={"request_id": rid, "peer": addr})
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import IO, Any

LOGGER_NAME = "kvd"

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()) | {
    "message",
    "asctime",
    "taskName",
}

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, extras, exc when present."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            obj.setdefault(key, value)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...``: readable, and still greppable by key."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_iso(record.created)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class RateLimitFilter(logging.Filter):
    """Let each (logger, message template) at WARNING+ through ``burst`` times per
    ``interval_s``; past that, drop and count, and report the count on the first
    record of that key once its window has rolled over.

    Keying on the template (``record.msg`` before %-formatting) rather than the
    final text groups "pull failed for r1" and "pull failed for r2" together,
    which is what a storm looks like. The clock is injectable for tests.
    """

    def __init__(
        self,
        burst: int = 10,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        min_level: int = logging.WARNING,
        max_keys: int = 4096,
    ) -> None:
        super().__init__()
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self.min_level = min_level
        self.max_keys = max_keys
        # key -> [window_start, emitted_in_window, suppressed_in_window]
        self._state: dict[tuple[str, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        state = self._state.get(key)
        if state is None or now - state[0] >= self.interval_s:
            suppressed = int(state[2]) if state is not None else 0
            if state is None and len(self._state) >= self.max_keys:
                self._state.clear()  # bounded memory beats perfect accounting
            self._state[key] = [now, 1, 0]
            if suppressed:
                record.suppressed = suppressed
                record.msg = f"{record.msg} (suppressed {suppressed} similar messages)"
            return True
        if state[1] < self.burst:
            state[1] += 1
            return True
        state[2] += 1
        return False

    def flush_suppressed(self) -> list[tuple[tuple[str, str], int]]:
        """Counts still pending (e.g. at shutdown), cleared; callers may log them."""
        pending = [(k, int(s[2])) for k, s in self._state.items() if s[2]]
        for key, _ in pending:
            self._state[key][2] = 0
        return pending


def configure_logging(
    fmt: str = "text",
    level: str = "info",
    stream: IO[str] | None = None,
    burst: int = 10,
    interval_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
    propagate: bool = False,
) -> logging.Logger:
    """(Re)configure the ``kvd`` logger: one handler, the chosen format, rate limiting.

    Idempotent: handlers installed by an earlier call are replaced, so tests and
    a re-exec never double every line. Propagation to the root logger is off so
    an embedding process's own logging setup does not print kvd lines twice.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r} is not 'text' or 'json'")
    if level.lower() not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {tuple(_LEVELS)}")
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):
        if getattr(old, "_kvd_handler", False):
            logger.removeHandler(old)
            old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler._kvd_handler = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RateLimitFilter(burst=burst, interval_s=interval_s, clock=clock))
    logger.addHandler(handler)
    logger.setLevel(_LEVELS[level.lower()])
    logger.propagate = propagate
    return logger
