"""The connector's rejoin after kvd lost the engine's registration: a restart (a new
instance adopts the pool) or a retirement by the same daemon while the engine lived on
(the pool given back). One line says which, and the handle is replaced either way."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from kvd.integrations.connector_core.rejoin import Rejoin


def _handle(instance: str, pool: str) -> SimpleNamespace:
    return SimpleNamespace(instance_id=instance, pool=SimpleNamespace(
        handle=SimpleNamespace(name=pool)))


class _Client:
    def __init__(self, new: SimpleNamespace) -> None:
        self.new = new

    def adopt_rank(self, old: object, via: object = None) -> SimpleNamespace:
        return self.new


@pytest.mark.parametrize(("new", "line"), [
    (_handle("i1", "kvd-1-aaaaaaaa-000000000001"), "gave its pool"),
    (_handle("i2", "kvd-2-bbbbbbbb-000000000001"), "registered again with kvd instance i2"),
])
def test_one_line_says_whether_the_daemon_restarted_or_gave_the_pool_back(
        caplog: pytest.LogCaptureFixture, new: SimpleNamespace, line: str) -> None:
    old = _handle("i1", "kvd-1-aaaaaaaa-000000000001")
    got = threading.Event()
    handles: list[object] = []
    rejoin = Rejoin(_Client(new), lambda: old, lambda h: (handles.append(h), got.set()),
                    "eng rank 0/0")
    try:
        with caplog.at_level(logging.WARNING, logger="kvd.vllm"):
            rejoin.kick("kvd said this engine is not registered")
            assert got.wait(5)
            deadline = time.monotonic() + 5  # the line follows the handle, on its thread
            while not [r for r in caplog.records if line in r.getMessage()]:
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.01)
        assert handles == [new] and rejoin.rejoined == 1
    finally:
        rejoin.close()
