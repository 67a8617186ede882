"""Logging set-up (kvd.ops.logsetup) on its own: text and JSON lines with their context
fields, reconfiguration, refusals, rate limiting of storms, and the bounds it keeps."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvd.ops.logsetup import RateLimitFilter, configure_logging


@pytest.fixture(autouse=True)
def _restore_kvd_logger() -> Iterator[None]:
    """configure_logging mutates the process-wide 'kvd' logger; put it back so other
    tests (caplog) see kvd records as before."""
    logger = logging.getLogger("kvd")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        if handler not in saved[0]:
            logger.removeHandler(handler)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().splitlines() if line]


def test_json_lines_carry_context_fields() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    log = logging.getLogger("kvd.daemon")
    log.warning(
        "pull failed: %s",
        "peer gone",
        extra={"request_id": "r1", "engine_id": "decode-0", "peer": "tcp://10.0.0.2:7101"},
    )
    log.debug("not shown at info")
    (line,) = _lines(stream)
    obj = json.loads(line)
    assert obj["level"] == "warning" and obj["logger"] == "kvd.daemon"
    assert obj["msg"] == "pull failed: peer gone"
    assert (obj["request_id"], obj["engine_id"], obj["peer"]) == (
        "r1",
        "decode-0",
        "tcp://10.0.0.2:7101",
    )
    assert obj["ts"].endswith("+00:00")


def test_json_exception_and_text_format() -> None:
    stream = io.StringIO()
    configure_logging("json", "debug", stream=stream)
    try:
        raise ValueError("bad geometry")
    except ValueError:
        logging.getLogger("kvd").exception("register refused", extra={"engine_id": "p0"})
    obj = json.loads(_lines(stream)[0])
    assert "ValueError: bad geometry" in obj["exc"]

    stream = io.StringIO()
    configure_logging("text", "info", stream=stream)
    logging.getLogger("kvd.peer").error("handshake timeout", extra={"peer": "tcp://h:7101"})
    (line,) = _lines(stream)
    assert "ERROR" in line and "kvd.peer: handshake timeout" in line
    assert line.endswith("peer=tcp://h:7101")


def test_reconfigure_does_not_duplicate_lines() -> None:
    stream = io.StringIO()
    configure_logging("text", "info")
    configure_logging("text", "info", stream=stream)
    logging.getLogger("kvd").info("once")
    assert len(_lines(stream)) == 1


def test_bad_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError):
        configure_logging("xml", "info")
    with pytest.raises(ValueError):
        configure_logging("text", "loud")


def test_repeated_warnings_are_rate_limited_then_summarised() -> None:
    clock, stream = FakeClock(), io.StringIO()
    configure_logging("json", "info", stream=stream, burst=3, interval_s=10.0, clock=clock)
    log = logging.getLogger("kvd.daemon")
    for i in range(50):  # same template, different arguments: one storm
        log.warning("pull %s failed", f"r{i}", extra={"request_id": f"r{i}"})
    for i in range(5):  # info is never limited
        log.info("published %s", i)
    log.warning("another template")  # separate key, not suppressed
    lines = [json.loads(x) for x in _lines(stream)]
    storm = [x for x in lines if x["msg"].startswith("pull ")]
    assert [x["request_id"] for x in storm] == ["r0", "r1", "r2"]
    assert sum(x["level"] == "info" for x in lines) == 5
    assert any(x["msg"] == "another template" for x in lines)

    clock.now += 9.9  # still inside the window
    log.warning("pull %s failed", "r50")
    assert len(_lines(stream)) == len(lines)

    clock.now += 0.2  # window rolled over: next line reports what was dropped
    log.warning("pull %s failed", "r51")
    last = json.loads(_lines(stream)[-1])
    assert last["suppressed"] == 48
    assert last["msg"] == "pull r51 failed (suppressed 48 similar messages)"


def test_rate_limit_filter_flush_reports_pending() -> None:
    clock = FakeClock()
    flt = RateLimitFilter(burst=1, interval_s=5.0, clock=clock)

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("kvd.x", logging.ERROR, __file__, 1, msg, None, None)

    assert [flt.filter(record("boom")) for _ in range(4)] == [True, False, False, False]
    assert flt.flush_suppressed() == [(("kvd.x", "boom"), 3)]
    assert flt.flush_suppressed() == []


def test_rate_limit_keys_are_bounded() -> None:
    """A storm of distinct templates cannot grow the filter without bound."""
    flt = RateLimitFilter(burst=1, interval_s=60.0, clock=FakeClock(), max_keys=8)
    for i in range(100):
        flt.filter(logging.LogRecord("kvd.x", logging.WARNING, __file__, 1, f"m{i}", None,
                                     None))
    assert len(flt._state) <= 8


def test_json_line_survives_an_extra_json_cannot_encode() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    logging.getLogger("kvd").warning("odd", extra={"blocks": {1, 2}, "obj": object()})
    obj = json.loads(_lines(stream)[0])
    assert obj["blocks"] == "{1, 2}" and obj["obj"].startswith("<object object")


def test_fresh_process_prints_each_line_once_beside_a_root_handler() -> None:
    """In a fresh interpreter whose root logger already has a handler (an embedding
    process, or vLLM's), kvd's lines appear once, from kvd's handler, not twice."""
    code = ("import logging, sys\n"
            "logging.basicConfig(stream=sys.stderr, format='ROOT %(message)s')\n"
            "from kvd.ops.logsetup import configure_logging\n"
            "configure_logging('text', 'info', stream=sys.stderr)\n"
            "logging.getLogger('kvd.daemon').warning('hello %s', 'there')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "hello there" in ln]
    assert len(lines) == 1 and "WARNING kvd.daemon: hello there" in lines[0]
    assert not lines[0].startswith("ROOT")
