"""`WarmUp`: a consumer engine names its producers at start-up, and its daemon greets
them in the background, so the first pull between two daemons does no handshake.
Real ``kvd serve`` processes (two on this host: same-host copies, and NIXL READs with
host_pulls off); the consumer names its producer before the producer has even
registered (a prefill engine that starts later), so the daemon's retries are proved
too. Counted by the consumer daemon's ``kvd_handshakes_total``."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from support.cluster import (
    Engine,
    Pair,
    deregister_and_check_freed,
    metric,
    register,
    running_pair,
    unique,
    wait_until,
)
from support.matrix_cases import model, shape

from kvd.tools.sim import layout_spec

pytestmark = pytest.mark.nixl

HANDSHAKES = "kvd_handshakes_total"


@pytest.fixture(scope="module", params=["host", "remote"])
def two(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[Pair, str]]:
    args = ["--set", f"host_pulls={'true' if request.param == 'host' else 'false'}"]
    with running_pair(tmp_path_factory.mktemp("kvd-logs"), args) as p:
        yield p, request.param


def _pull(p: Pair, producer: str, consumer: str, src: list[int], dst: list[int]) -> str:
    rid = unique("req")
    p.pc.publish(producer, rid, src)
    p.dc.pull(consumer, rid, producer, p.prefill.peer_address, src, dst)
    ev = p.dc.wait(consumer, rid, "done_recving", timeout_s=30)
    assert ev.ok, ev.error
    assert p.pc.wait(producer, rid, "done_sending", timeout_s=30).ok
    return rid


def test_the_first_pull_after_a_warm_up_does_no_handshake(two) -> None:
    p, path = two
    m = model()
    consumer = register(p.dc, "wdec", m, shape(1))
    producer_id = unique("wpre")
    greeted0 = metric(p.decode, HANDSHAKES, outcome="ok")
    # named before the producer exists: the daemon keeps trying in the background
    p.dc.warm_up(consumer.engine_id, [(producer_id, p.prefill.peer_address)])
    producer = None
    try:
        producer = Engine(producer_id, m, shape(1))  # registers after the warm-up came
        producer.ranks.append(p.pc.register(producer_id, m, layout_spec(producer.shape)))
        wait_until(lambda: metric(p.decode, HANDSHAKES, outcome="ok") == greeted0 + 1,
                   15.0, what="the warm-up's handshake")
        rid = _pull(p, producer_id, consumer.engine_id, [1, 2, 3], [4, 5, 6])
        # the pull found the pair warm: no handshake of its own
        assert metric(p.decode, HANDSHAKES, outcome="ok") == greeted0 + 1
        [done] = [f for f in p.dc.status().finished_pulls if f.request_id == rid]
        assert done.path == path
    finally:
        if producer is not None:
            deregister_and_check_freed(p.pc, producer)
        deregister_and_check_freed(p.dc, consumer)


def test_without_a_warm_up_the_first_pull_greets(two) -> None:
    """The control: the same pair, not named ahead, greets on its first pull."""
    p, _ = two
    m = model()
    consumer = register(p.dc, "cdec", m, shape(1))
    producer = register(p.pc, "cpre", m, shape(1))
    try:
        greeted0 = metric(p.decode, HANDSHAKES, outcome="ok")
        _pull(p, producer.engine_id, consumer.engine_id, [1, 2], [3, 4])
        assert metric(p.decode, HANDSHAKES, outcome="ok") == greeted0 + 1
    finally:
        deregister_and_check_freed(p.pc, producer)
        deregister_and_check_freed(p.dc, consumer)


LIVENESS_S = 1.0


@pytest.fixture(scope="module", params=["host", "remote"])
def short_liveness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Pair, str]]:
    args = ["--set", f"host_pulls={'true' if request.param == 'host' else 'false'}",
            "--set", f"peer_liveness_timeout_s={LIVENESS_S}"]
    with running_pair(tmp_path_factory.mktemp("kvd-logs"), args) as p:
        yield p, request.param


def test_a_pair_dropped_by_a_stall_is_warm_again_before_its_next_pull(short_liveness) -> None:
    """Both daemons stopped (a host starved of CPU; `kvd bench vllm` pauses a system so)
    for longer than peer_liveness_timeout_s: on waking, ZMTP heartbeats drop the
    connection and its cached handshakes. When the redial connects, the consumer greets
    the pair again in the background, so the next pull does no handshake of its own
    (before, each first pull after a stall greeted, mapped pool files and loaded NIXL
    metadata on its path: 2x a warm pull in whole engines)."""
    p, path = short_liveness
    m = model()
    consumer = register(p.dc, "sdec", m, shape(1))
    producer = register(p.pc, "spre", m, shape(1))
    try:
        greeted0 = metric(p.decode, HANDSHAKES, outcome="ok")
        _pull(p, producer.engine_id, consumer.engine_id, [1, 2], [3, 4])
        assert metric(p.decode, HANDSHAKES, outcome="ok") == greeted0 + 1
        # The producer stops first and the consumer a few heartbeats later, as a starved
        # host (or the bench's pause) stops them: a PING of the consumer's is left
        # unanswered, and its timeout has run out when the consumer wakes.
        p.prefill.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(LIVENESS_S / 2)
            p.decode.proc.send_signal(signal.SIGSTOP)
            time.sleep(LIVENESS_S * 2)
        finally:
            p.prefill.proc.send_signal(signal.SIGCONT)
            p.decode.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: "dropped cached handshakes" in p.decode.log_path.read_text(),
                   10.0, what="the connection's drop after the stall")
        wait_until(lambda: metric(p.decode, HANDSHAKES, outcome="ok") == greeted0 + 2,
                   10.0, what="the handshake made again once the connection was back")
        rid = _pull(p, producer.engine_id, consumer.engine_id, [5, 6], [7, 8])
        assert metric(p.decode, HANDSHAKES, outcome="ok") == greeted0 + 2
        [done] = [f for f in p.dc.status().finished_pulls if f.request_id == rid]
        assert done.path == path
    finally:
        deregister_and_check_freed(p.pc, producer)
        deregister_and_check_freed(p.dc, consumer)
