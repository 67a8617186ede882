"""Restart identity, in process: a daemon incarnation is known by its instance id.

A consumer drops a cached handshake when its producer daemon restarted (another
instance in a reply, or the connection dropped), when a READ from it failed, and
when a pull names another address; the next pull handshakes again and succeeds
without any retry by the engine. A producer that is gone fails pulls with
``peer_lost``. (tests/daemon/peers/test_restart.py does the same with kill -9 and NIXL.)
"""

from __future__ import annotations

import asyncio
import time

from support.inprocess import daemon_pair, run, sample, start_daemon, wait_event

from kvd.client import AsyncKvdClient
from kvd.daemon.peers.remote import RemoteDaemon
from kvd.tools.localcluster import free_port
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="restart", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, block_size_tokens=4, num_blocks=16)


async def _register(client: AsyncKvdClient, engine_id: str):
    return await client.register(engine_id, MODEL, layout_spec(SHAPE), 0, 1)


async def _pulled_once(p) -> str:
    """Engines "pre" and "dec" registered and one pull between them done (its handshake
    cached): the producer daemon's peer address."""
    await _register(p.pc, "pre")
    await _register(p.dc, "dec")
    addr = p.prefill.cfg.peer_address
    await p.pc.publish("pre", "r0", [1])
    await p.dc.pull("dec", "r0", "pre", addr, [1], [2])
    assert (await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")).ok
    return addr


def _handshakes(d) -> float:
    return sample(d, "kvd_handshakes_total", outcome="ok")


def test_a_restarted_producer_is_greeted_again_and_the_first_pull_succeeds() -> None:
    async def body() -> None:
        async with daemon_pair(handshake_timeout_s=1.0) as p:
            pre = await _register(p.pc, "pre")
            dec = await _register(p.dc, "dec")
            await p.pc.publish("pre", "r0", [1])
            await p.dc.pull("dec", "r0", "pre", p.prefill.cfg.peer_address, [1], [2])
            assert (await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")).ok
            old_instance = pre.instance_id
            p.pc.close()
            await p.prefill.stop()
            # Same addresses, same engine id: a new incarnation.
            p.prefill = await start_daemon(p.prefix, p.clock, cfg=p.prefill.cfg)
            pc = AsyncKvdClient(p.prefill.cfg.engine_address, timeout_s=5, ping_interval_s=0)
            try:
                pre = await _register(pc, "pre")
                assert pre.instance_id != old_instance
                g = global_kv(MODEL, 8)
                write_shard(pre.kv, g, MODEL, SHAPE, 0, 0, [3, 4])
                await pc.publish("pre", "r1", [3, 4])
                # ZMQ redials every 100 ms of real time; fake time outruns that, and a
                # pull while the connection is down fails at once.
                conn = p.decode.peers.conns[p.prefill.cfg.peer_address]
                await _until_real(lambda: conn.connected is True, "the redial")
                await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [3, 4], [5, 6],
                                num_tokens=8)
                ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
                assert ev.ok, ev.error
                assert check_shard(dec.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0
                assert _handshakes(p.decode) == 2
                [peer] = (await p.dc.status()).peers
                assert peer.instance == p.prefill.instance_id
            finally:
                p.pc = pc  # closed by daemon_pair

    run(body())


def test_a_reply_from_another_incarnation_makes_the_pull_handshake_again() -> None:
    """No disconnect noticed: the Acquire reply's instance alone proves the cache stale."""
    async def body() -> None:
        async with daemon_pair() as p:
            addr = await _pulled_once(p)
            [remote] = p.decode.peers.remotes.values()
            d = remote.daemons[addr]
            remote.daemons[addr] = RemoteDaemon(d.address, d.agent, "an-old-incarnation",
                                                d.epoch)
            await p.pc.publish("pre", "r1", [1])
            await p.dc.pull("dec", "r1", "pre", addr, [1], [3])
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert ev.ok, ev.error
            assert _handshakes(p.decode) == 2

    run(body())


def test_another_instance_seen_on_a_connection_drops_what_was_cached() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            addr = await _pulled_once(p)
            assert p.decode.peers.remotes
            p.decode.peers.conns[addr]._saw_instance("restarted-elsewhere")
            assert p.decode.peers.remotes == {}

    run(body())


def test_a_failed_read_drops_the_cached_peer() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            await _register(p.pc, "pre")
            await _register(p.dc, "dec")
            addr = p.prefill.cfg.peer_address
            # the receipt: a READ that cannot predate the publish is never read again
            receipt = await p.pc.publish("pre", "r0", [1])
            p.decode.datapath.transport.fail_next_reads = 1
            await p.dc.pull("dec", "r0", "pre", addr, [1], [2], publish_receipt=receipt)
            ev = await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")
            assert not ev.ok and ev.error.startswith("transfer_failed")
            assert p.decode.peers.remotes == {}
            await p.pc.publish("pre", "r1", [1])
            await p.dc.pull("dec", "r1", "pre", addr, [1], [2])
            assert (await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")).ok
            assert _handshakes(p.decode) == 2

    run(body())


def test_a_pull_naming_another_address_handshakes_there() -> None:
    """The engine moved to another daemon: the cache must not send the pull to the old one."""
    async def body() -> None:
        async with daemon_pair() as p:
            other = await start_daemon(p.prefix, p.clock)
            oc = AsyncKvdClient(other.cfg.engine_address, timeout_s=5, ping_interval_s=0)
            try:
                await _register(p.pc, "pre")
                dec = await _register(p.dc, "dec")
                await p.pc.publish("pre", "r0", [1])
                await p.dc.pull("dec", "r0", "pre", p.prefill.cfg.peer_address, [1], [2])
                assert (await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")).ok
                moved = await _register(oc, "pre")  # same engine id, another daemon
                g = global_kv(MODEL, 4, seed=9)
                write_shard(moved.kv, g, MODEL, SHAPE, 0, 0, [7])
                await oc.publish("pre", "r1", [7])
                await p.dc.pull("dec", "r1", "pre", other.cfg.peer_address, [7], [8])
                ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
                assert ev.ok, ev.error
                assert check_shard(dec.kv, g, MODEL, SHAPE, 0, 0, [8]) == 0
            finally:
                await oc.aclose()
                await other.stop()

    run(body())


def test_a_pull_from_a_producer_that_went_away_fails_with_peer_lost() -> None:
    async def body() -> None:
        async with daemon_pair(handshake_timeout_s=1.0) as p:
            pre = await _register(p.pc, "pre")
            await _register(p.dc, "dec")
            addr = p.prefill.cfg.peer_address
            await p.pc.publish("pre", "r0", [1])
            await p.dc.pull("dec", "r0", "pre", addr, [1], [2])
            assert (await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")).ok
            pre.pool.close()
            await p.prefill.stop()
            await p.clock.until(lambda: p.decode.peers.conns[addr].connected is False,
                                what="the disconnect seen")
            await p.dc.pull("dec", "r1", "pre", addr, [1], [3])
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=3.0)
            assert not ev.ok and ev.error.startswith("peer_lost"), ev.error
            assert ev.invalid_block_ids == [3]
            p.prefill = await start_daemon(p.prefix, p.clock, cfg=p.prefill.cfg)  # for stop()

    run(body())


async def _until_real(predicate, what: str, timeout_s: float = 5.0) -> None:
    """Real time: ZMQ's connection events and redials run on its own I/O thread."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s}s"
        await asyncio.sleep(0.01)


def test_a_pull_to_a_known_dead_peer_fails_at_once_and_a_restarted_one_works_at_once() -> None:
    """Once the daemon knows the producer's daemon is gone (its connection
    dropped and is not back), a new pull fails peer_lost at once instead of after
    handshake_timeout_s; the moment a new incarnation listens at that address again, the
    next pull greets it and succeeds."""
    async def body() -> None:
        async with daemon_pair(handshake_timeout_s=5.0) as p:
            await _register(p.pc, "pre")
            await _register(p.dc, "dec")
            await p.pc.publish("pre", "r0", [1])
            addr = p.prefill.cfg.peer_address
            await p.dc.pull("dec", "r0", "pre", addr, [1], [2])
            assert (await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")).ok
            conn = p.decode.peers.conns[addr]
            p.pc.close()
            await p.prefill.stop()
            await _until_real(lambda: conn.connected is False, "the drop seen")
            t0 = p.clock.now()
            await p.dc.pull("dec", "r1", "pre", addr, [1], [2])
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=1.0)
            took_s = p.clock.now() - t0
            assert not ev.ok and ev.error.startswith("peer_lost"), ev.error
            assert "unreachable" in ev.error and took_s < 1.0, (took_s, ev.error)
            p.prefill = await start_daemon(p.prefix, p.clock, cfg=p.prefill.cfg)
            pc = AsyncKvdClient(p.prefill.cfg.engine_address, timeout_s=5, ping_interval_s=0)
            try:
                await _register(pc, "pre")
                await pc.publish("pre", "r2", [1])
                await _until_real(lambda: conn.connected is True, "the redial")
                await p.dc.pull("dec", "r2", "pre", addr, [1], [2])
                ev = await wait_event(p.dc, p.clock, "dec", "r2", "done_recving", fake_s=1.0)
                assert ev.ok, ev.error
                assert _handshakes(p.decode) == 2
            finally:
                p.pc = pc  # closed by daemon_pair

    run(body())


def test_a_peer_never_reached_fails_within_the_liveness_timeout() -> None:
    """Heartbeats cannot judge a connection that never came up (a cut link drops the
    dial): a handshake to a peer not connected within peer_liveness_timeout_s fails
    peer_lost then, not after handshake_timeout_s."""
    async def body() -> None:
        async with daemon_pair(handshake_timeout_s=5.0, peer_liveness_timeout_s=1.0) as p:
            await _register(p.dc, "dec")
            t0 = p.clock.now()
            await p.dc.pull("dec", "r1", "pre", f"tcp://127.0.0.1:{free_port()}", [1], [2])
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=3.0)
            took_s = p.clock.now() - t0
            assert not ev.ok and ev.error.startswith("peer_lost"), ev.error
            assert "no connection" in ev.error and 1.0 <= took_s < 1.5, (took_s, ev.error)

    run(body())


def test_pairs_a_dropped_connection_took_are_greeted_again_once_it_is_back(
        monkeypatch) -> None:
    """Only a drop of the connection itself is remembered (a restart or a failed request
    is greeted by the next pull), once per pair, and the memory of such pairs is bounded
    (a peer that never comes back)."""
    from kvd.daemon.peers import table

    async def body() -> None:
        async with daemon_pair() as p:
            addr = await _pulled_once(p)
            peers, greeted = p.decode.peers, _handshakes(p.decode)
            peers.drop_address(addr, "no answer")
            assert peers.remotes == {} and peers._lost_pairs == {}
            peers._up(addr)  # nothing to warm: the next pull greets
            await p.pc.publish("pre", "r1", [1])
            await p.dc.pull("dec", "r1", "pre", addr, [1], [3])
            assert (await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")).ok
            assert _handshakes(p.decode) == greeted + 1
            peers.drop_address(addr, "disconnected")
            assert peers._lost_pairs == {addr: {("dec", "pre", addr)}}
            peers._up(addr)
            assert peers._lost_pairs == {}
            for _ in range(200):
                if peers.remotes:
                    break
                await asyncio.sleep(0.01)
            assert list(peers.remotes) == [("dec", "pre")]
            assert _handshakes(p.decode) == greeted + 2
            monkeypatch.setattr(table, "MAX_LOST_PAIRS", 2)
            peers._lost_pairs = {"tcp://gone-1:1": {("a", "b", "x")},
                                 "tcp://gone-2:1": {("c", "d", "y")}}
            peers.drop_address(addr, "disconnected")
            assert peers._lost_pairs == {addr: {("dec", "pre", addr)}}

    run(body())
