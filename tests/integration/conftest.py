"""Fixtures of the integration suite: kvd daemons as real processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kvd_itest import start_daemon, stop_and_check_clean

from kvd.client import KvdClient
from kvd.localcluster import DaemonProcess


@dataclass
class Pair:
    prefill: DaemonProcess
    decode: DaemonProcess
    pc: KvdClient
    dc: KvdClient


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Pair]:
    """One prefill and one decode daemon for a whole module (starting one costs ~1 s).

    A module may set ``DAEMON_ARGS`` (extra ``kvd serve`` arguments for both daemons).
    """
    logs = tmp_path_factory.mktemp("kvd-logs")
    args = list(getattr(request.module, "DAEMON_ARGS", []))
    prefill = start_daemon(logs, "p", args)
    try:
        decode = start_daemon(logs, "d", args)
    except BaseException:
        prefill.kill()
        raise
    pc, dc = prefill.client(), decode.client()
    try:
        yield Pair(prefill, decode, pc, dc)
    finally:
        pc.close()
        dc.close()
        try:
            stop_and_check_clean(prefill)
        finally:
            stop_and_check_clean(decode)
