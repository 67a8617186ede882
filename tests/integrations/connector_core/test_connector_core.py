"""The connector's logic without vLLM: the messages between its halves, the scheduler's
handshake, the CUDA allocator shim's build, and the line an engine logs when no kvd
answers its registration."""

from __future__ import annotations

import ctypes
import logging
import shutil
import socket
from dataclasses import dataclass

import pytest
from support.connector_cases import tiny_geometry

from kvd.errors import KvdError, KvdTimeoutError
from kvd.integrations.connector_core import cuda_alloc
from kvd.integrations.connector_core.messages import (
    Handshake,
    StepAnnouncements,
    WorkerRejoined,
    as_vllm,
)
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.integrations.connector_core.worker import KvdWorker
from kvd.tools.localcluster import free_port
from kvd.wire import stream as S


def _settings(address: str = "tcp://127.0.0.1:1", **extra: object) -> ConnectorSettings:
    from types import SimpleNamespace

    return ConnectorSettings.from_vllm(SimpleNamespace(
        engine_id="prefill-0", kv_connector_extra_config={"kvd_address": address, **extra}))


@dataclass
class CarriedAnnouncements(StepAnnouncements):  # stands in for vLLM's metadata subclass
    pass


def test_as_vllm_keeps_every_field_and_shares_the_values():
    step = StepAnnouncements(recv={"r1": [1, 2]}, quiet=["q"], sent={"s": 3.0}, rejoin=True)
    carried = as_vllm(step, CarriedAnnouncements)
    assert isinstance(carried, StepAnnouncements) and carried == CarriedAnnouncements(
        recv={"r1": [1, 2]}, quiet=["q"], sent={"s": 3.0}, rejoin=True)
    assert carried.recv is step.recv
    assert as_vllm(WorkerRejoined("tcp://a", "i2"), WorkerRejoined).instance_id == "i2"


def test_scheduler_takes_the_first_handshake_naming_a_daemon():
    sched = KvdScheduler(_settings(), block_size_tokens=16)
    try:
        sched.set_handshake({0: None, 1: Handshake(peer_address="", daemon_id="d"),
                             2: Handshake(peer_address="tcp://127.0.0.1:7300",
                                          daemon_id="d", instance_id="inst-1")})
        assert (sched.peer_address, sched.daemon_instance) == ("tcp://127.0.0.1:7300",
                                                               "inst-1")
        assert sched.build_meta() == StepAnnouncements()  # nothing queued, nothing said
    finally:
        sched.close()


def test_the_scheduler_opens_its_direct_door_at_start_up():
    """A decode's first pull must not pay the door's connect and the daemon's accept on
    its way (1-3 ms of a pair's first hand-over in whole engines): the scheduler side
    opens the door when vLLM hands it the workers' handshake, before any request."""
    address = f"tcp://127.0.0.1:{free_port()}"
    name = S.direct_name(address)
    assert name is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as door:
        door.bind(S.address_of(name))
        door.listen(1)
        door.setblocking(False)
        sched = KvdScheduler(_settings(address), block_size_tokens=16)
        try:
            with pytest.raises(BlockingIOError):
                door.accept()  # nobody yet
            sched.set_handshake({0: Handshake(peer_address="tcp://127.0.0.1:7300",
                                              daemon_id="d", instance_id="inst-1")})
            conn, _ = door.accept()  # connected already, nothing sent
            conn.close()
            assert sched.client.direct and sched.client.sent_direct == 0
        finally:
            sched.close()


def test_registration_nobody_answers_is_one_line_naming_the_address_and_the_fix(caplog):
    """Nothing listens at the address: the worker logs one ERROR line that names the
    address and what to start, and raises with the same line (no second cause)."""
    worker = KvdWorker(_settings("tcp://127.0.0.1:9", kvd_request_timeout_s=0.3),
                       tiny_geometry())
    try:
        with caplog.at_level(logging.ERROR, logger="kvd.vllm"), \
                pytest.raises(KvdTimeoutError) as err:
            worker.register()
    finally:
        worker.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert lines == [str(err.value)]
    assert "\n" not in lines[0]
    assert "tcp://127.0.0.1:9" in lines[0] and "`kvd serve`" in lines[0]
    assert "kvd_address" in lines[0]
    assert err.value.__cause__ is None and err.value.__suppress_context__


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_cuda_shim_builds_once_and_serves_only_its_region(tmp_path, monkeypatch):
    monkeypatch.setenv("KVD_CUDA_ALLOC_DIR", str(tmp_path))
    lib_path = cuda_alloc.build_shim()
    assert lib_path == tmp_path / "libkvd_cuda_alloc.so" and lib_path.exists()
    mtime = lib_path.stat().st_mtime_ns
    assert cuda_alloc.build_shim() == lib_path and lib_path.stat().st_mtime_ns == mtime
    lib = ctypes.CDLL(str(lib_path))
    lib.kvd_malloc.restype = ctypes.c_void_p
    lib.kvd_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    region = ctypes.create_string_buffer(4096)
    lib.kvd_set_region(ctypes.c_void_p(ctypes.addressof(region)), ctypes.c_size_t(4096))
    lib.kvd_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                             ctypes.c_void_p]
    assert lib.kvd_malloc(8192, 0, None) is None  # larger than the pool: refused
    assert lib.kvd_region_was_served() == 0
    assert lib.kvd_malloc(4096, 0, None) == ctypes.addressof(region)
    assert lib.kvd_region_was_served() == 1
    assert lib.kvd_malloc(16, 0, None) is None  # one allocation only: the KV cache
    lib.kvd_free(ctypes.addressof(region), 4096, 0, None)
    assert lib.kvd_malloc(4096, 0, None) == ctypes.addressof(region)
    assert list(tmp_path.iterdir()) == [lib_path]  # no temporary file left


def test_cuda_shim_that_cannot_build_is_one_line_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("KVD_CUDA_ALLOC_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(KvdError) as err:
        cuda_alloc.build_shim()
    msg = str(err.value)
    assert "\n" not in msg and "with false" in msg
    assert "python -m kvd.integrations.connector_core.cuda_alloc" in msg
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KvdError, match="no-such-compiler"):
        cuda_alloc.build_shim()
    assert list(tmp_path.iterdir()) == []
