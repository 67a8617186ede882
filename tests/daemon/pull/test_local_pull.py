"""One daemon for both engines: a pull whose producer is registered with the same
``kvd serve`` is a local copy, byte-exact over the whole shape matrix (hetero TP both
ways, GQA, MLA, uneven PP, block-size ratios, prefix hits, every layout), named by the
daemon's own peer address however it is spelled, with the same events as a remote pull.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.cluster import (
    deregister_and_check_freed,
    metric,
    register,
    run_transfer,
    start_daemon,
    stop_and_check_clean,
)
from support.matrix_cases import CASES, model, shape

from kvd.client import KvdClient
from kvd.tools.localcluster import DaemonProcess

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, KvdClient]]:
    d = start_daemon(tmp_path_factory.mktemp("kvd-logs"), "one")
    c = d.client()
    try:
        yield d, c
    finally:
        c.close()
        stop_and_check_clean(d)


def _finished(c: KvdClient, request_prefix: str) -> list:
    return [p for p in c.status().finished_pulls if p.request_id.startswith(request_prefix)]


@pytest.mark.parametrize("case", list(CASES))
def test_local_pull_is_byte_exact(one, case: str) -> None:
    d, c = one
    copied = metric(d, "kvd_transfers_total", role="consumer", path="local")
    m, pshape, dshape, tokens, skip = CASES[case]
    res = run_transfer(d, d, c, c, m, pshape, dshape, tokens, skip_tokens=skip)
    assert res.recv.ok, res.recv.error
    assert res.recv.invalid_block_ids == [] and res.recv.nbytes > 0
    assert res.mismatches == 0
    assert res.stray == 0, "bytes landed outside the pulled blocks"
    assert res.sent.ok, res.sent.error  # the hold released once the copy ended
    assert metric(d, "kvd_transfers_total", role="consumer", path="local") == copied + 1
    assert metric(d, "kvd_transfers_total", role="consumer", path="remote") == 0


@pytest.mark.parametrize("spelling", ["localhost", "0.0.0.0"])
def test_the_daemon_recognises_itself_however_its_address_is_spelled(one, spelling) -> None:
    d, c = one
    host, _, port = d.peer_address.removeprefix("tcp://").rpartition(":")
    assert host == "127.0.0.1"
    spelled = d.peer_address.replace(host, spelling)

    class Spelled:
        peer_address = spelled

    res = run_transfer(Spelled, d, c, c, model(), shape(1), shape(2), 64)  # type: ignore[arg-type]
    assert res.recv.ok, res.recv.error
    assert res.mismatches == 0 and res.stray == 0
    assert metric(d, "kvd_transfers_total", role="consumer", path="remote") == 0


def test_status_shows_a_finished_local_pull_for_a_while(one) -> None:
    d, c = one
    run_transfer(d, d, c, c, model(), shape(2), shape(1), 64)
    done = [p for p in c.status().finished_pulls if p.state == "done"]
    assert done and {p.path for p in done} == {"local"}
    assert c.status().pulls == []  # in flight: none


def test_a_pull_from_an_engine_not_registered_here_fails_cleanly(one) -> None:
    d, c = one
    dec = register(c, "dec", model(), shape(1))
    try:
        c.pull(dec.engine_id, "nobody-home", "no-such-engine", d.peer_address, [1, 2], [3, 4])
        ev = c.wait(dec.engine_id, "nobody-home", "done_recving", timeout_s=10)
        assert not ev.ok and ev.invalid_block_ids == [3, 4]
        assert "not registered" in ev.error or "not_found" in ev.error, ev.error
    finally:
        deregister_and_check_freed(c, dec)
