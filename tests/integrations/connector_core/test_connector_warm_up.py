"""The decode engine's connector names its producers (``kvd_producers``) to its daemon at
registration, and that daemon greets them in the background: before any pull, the
consumer daemon has done the handshake with the producer's. Real ``kvd serve``
processes and the connector's own worker half (no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.cluster import metric, start_daemon, stop_and_check_clean, wait_until
from support.connector_cases import tiny_geometry

from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.integrations.connector_core.worker import KvdWorker
from kvd.tools.localcluster import DaemonProcess

pytestmark = pytest.mark.nixl


def _worker(engine_id: str, address: str, **extra: object) -> KvdWorker:
    return KvdWorker(ConnectorSettings.from_vllm(SimpleNamespace(
        engine_id=engine_id, kv_connector_extra_config={"kvd_address": address, **extra})),
        tiny_geometry())


def test_a_decode_engine_naming_its_producer_has_its_daemon_greet_it(tmp_path) -> None:
    prefill_d = start_daemon(tmp_path, "wp")
    decode_d = start_daemon(tmp_path, "wd")
    workers: list[KvdWorker] = []
    try:
        decode = _worker("decode-0", decode_d.engine_address, kvd_producers=[
            {"engine_id": "prefill-0", "address": prefill_d.peer_address}])
        workers.append(decode)
        decode.register()  # the decode engine starts first, naming a producer not yet up
        assert metric(decode_d, "kvd_handshakes_total", outcome="ok") == 0
        prefill = _worker("prefill-0", prefill_d.engine_address)
        workers.append(prefill)
        prefill.register()
        wait_until(lambda: metric(decode_d, "kvd_handshakes_total", outcome="ok") == 1, 15.0,
                   what="the decode daemon's handshake with the prefill's")
        [peer] = decode.client.status().peers
        assert (peer.local_engine, peer.remote_engine) == ("decode-0", "prefill-0")
    finally:
        for w in workers:
            w.close()
        stop_and_check_clean(decode_d)
        stop_and_check_clean(prefill_d)


def test_after_its_daemon_restarts_the_decode_engine_names_its_producer_again(tmp_path):
    """A restarted daemon knows none of the engine's producers: the connector, which
    registers again with the new incarnation (adopting its pool), names them again, so
    the first pull after the restart does not greet."""
    prefill_d = start_daemon(tmp_path, "rp")
    decode_d = start_daemon(tmp_path, "rd")
    workers: list[KvdWorker] = []
    try:
        prefill = _worker("prefill-0", prefill_d.engine_address)
        workers.append(prefill)
        prefill.register()
        decode = _worker("decode-0", decode_d.engine_address, kvd_producers=[
            {"engine_id": "prefill-0", "address": prefill_d.peer_address}])
        workers.append(decode)
        decode.register()
        wait_until(lambda: metric(decode_d, "kvd_handshakes_total", outcome="ok") == 1, 15.0,
                   what="the first daemon's handshake")
        decode_d.kill()  # a crash; the engine lives on with its pool
        decode_d = DaemonProcess.start(decode_d.name, tmp_path,
                                       engine_address=decode_d.engine_address,
                                       peer_address=decode_d.peer_address, timeout_s=60.0)
        wait_until(lambda: decode.rejoin.rejoined == 1, 30.0,
                   what="the decode worker registered with the new daemon")
        wait_until(lambda: metric(decode_d, "kvd_handshakes_total", outcome="ok") == 1, 15.0,
                   what="the new daemon's handshake with the prefill's, with no pull")
    finally:
        for w in workers:
            w.close()
        stop_and_check_clean(decode_d)
        stop_and_check_clean(prefill_d)
