"""The end of a pull's READs: release, and the quarantine of a failing pull's READs.

The rule (docs/reliability.md "No write after hand-back"): a pull is reported, and its
local blocks handed back, only once none of its READs can land any more, that is once
the transport has completed or failed every one. Releasing a running NIXL request does
not stop UCX (``ucp_request_cancel`` is a no-op for RMA; NIXL 1.5 closes endpoints in
flush mode), and across a partition a READ resumes when the link comes back. So a
failing pull whose READs still run is QUARANTINED (not reported, blocks kept, counted
in ``kvd_quarantined_pulls``/``kvd_quarantined_bytes``, listed by ``kvd status``), and
kvd makes those READs end: it severs the data connections to their producers
(`Transport.sever_peer`) at once when the pull ran past ``transfer_timeout_s`` or the
producer's control connection is lost (liveness: a dead, partitioned or frozen
daemon), otherwise after ``peer_liveness_timeout_s`` (the transport may end them on its
own first: a lost hold on a live producer). A severed connection fails its READs at
their next poll.

Where nothing can be severed (an RDMA fabric under NIXL 1.5: no socket to shut, no
forced endpoint close) the pull stays quarantined until the transport ends the READ,
possibly for as long as the daemon runs (NIXL PR #2047). That is bounded: past
``max_quarantined_pulls`` or ``max_quarantined_bytes`` a new pull fails ``busy`` before
posting anything, rather than let stuck READs pin memory without end.
"""

from __future__ import annotations

import asyncio
import logging

from kvd.daemon.datapath import XferState
from kvd.daemon.pull_job import PullJob, PullState
from kvd.daemon.services import Services
from kvd.errors import BusyError

log = logging.getLogger("kvd.consumer")

FIRST_POLL_S = 0.0001
QUARANTINE_POLL_S = 0.05  # a failing pull's READs polled until the transport ends them
QUARANTINE_LOG_S = 10.0


def _host_port(address: str) -> tuple[str, int]:
    """("host", port) of a "tcp://host:port" endpoint (port 0 when there is none)."""
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host:
        return rest.strip("[]"), 0
    return host.strip("[]"), int(port) if port.isdigit() else 0


class Quarantine:
    """Failing pulls whose READs may still land, and the teardown that ends those READs."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.pulls = 0
        self.nbytes = 0

    def check_room(self, nbytes: int) -> None:
        """Raise BusyError when one more quarantined pull of ``nbytes`` would pass a cap.

        Called before posting: a pull refused here has nothing in flight to lose."""
        cfg = self.svc.cfg
        if self.pulls >= cfg.max_quarantined_pulls or (
                self.pulls and self.nbytes + nbytes > cfg.max_quarantined_bytes):
            raise BusyError(
                f"{self.pulls} pulls ({self.nbytes} bytes) are quarantined: READs the "
                "transport has not ended may still land in their blocks (max_quarantined_"
                f"pulls={cfg.max_quarantined_pulls}, max_quarantined_bytes="
                f"{cfg.max_quarantined_bytes}); no new pull until they end")

    async def release(self, job: PullJob) -> None:
        """Release every transfer handle, then unpin the local pools; a READ the transport
        has not ended yet is ended first (`_settle`), so that the pull is reported (and
        its blocks handed back) only once no byte of it can land any more."""
        if job.xfers:
            xfers, job.xfers = job.xfers, []
            await asyncio.shield(self._settle_and_release(job, xfers))
        self.unpin(job)

    @staticmethod
    def unpin(job: PullJob) -> None:
        """Unpin the pull's local pools: only once no READ of it can land any more."""
        assert not job.xfers, "unpinned with transfer handles not released"
        for r in job.pinned:
            r.pins -= 1
        job.pinned = []

    async def _settle_and_release(self, job: PullJob, xfers: list[int]) -> None:
        await self._settle(job)
        await self.svc.datapath.release(xfers)

    def _producers(self, job: PullJob) -> dict[str, list[str]]:
        """Agent -> control addresses of the producers a live READ of ``job`` reads from."""
        remote = job.remote
        if remote is None:
            return {}
        agents = {job.reading_from.get(x) for x in job.live}
        if None in agents:  # a READ whose producer is not noted (a discarded one): all
            agents = {d.agent for d in remote.daemons.values()}
        out: dict[str, list[str]] = {}
        for addr, d in remote.daemons.items():
            if d.agent in agents:
                out.setdefault(d.agent, []).append(addr)
        return out

    def _lost(self, addrs: list[str]) -> bool:
        """Whether liveness has lost the control connection to one of these daemons."""
        conns = self.svc.peers.conns
        return any(conns[a].connected is False for a in addrs if a in conns)

    async def _sever(self, agent: str, addrs: list[str]) -> int:
        """Tear down the data connections to that producer (`Transport.sever_peer`),
        sparing the daemon's own sockets (its listeners, the peer's control port)."""
        cfg = self.svc.cfg
        hosts = tuple(sorted({_host_port(a)[0] for a in addrs}))
        spare_remote = tuple(sorted({_host_port(a)[1] for a in addrs}))
        spare_local = tuple(sorted({p for p in (_host_port(cfg.peer_address)[1],
                                                _host_port(cfg.engine_address)[1],
                                                cfg.metrics_port) if p}))
        transport = self.svc.datapath.transport
        shut = await self.svc.datapath.call(transport.sever_peer, agent, hosts, spare_local,
                                            spare_remote)
        if shut:  # its NIXL endpoint fails now: the next pull loads the peer afresh
            for addr in addrs:
                self.svc.peers.drop_address(addr, "READ connections severed")
        return shut

    async def _settle(self, job: PullJob) -> None:
        """Until the transport has ended (completed or failed) every READ of a failing
        pull: the pull is QUARANTINED meanwhile, and its READs are made to end by
        severing their connections (at once past the deadline or when liveness lost the
        producer, else after peer_liveness_timeout_s). Not when the daemon is stopping:
        its NIXL agent and every UCX endpoint go with it."""
        if not job.live or job.cancel_reason is not None:
            return
        svc, state, nbytes = self.svc, job.state, job.nbytes
        job.state = PullState.QUARANTINED
        self.pulls += 1
        self.nbytes += nbytes
        svc.metrics.quarantined_pulls.inc()
        svc.metrics.quarantined_bytes.inc(nbytes)
        t0, interval_s = svc.clock.now(), FIRST_POLL_S
        next_log_s = QUARANTINE_LOG_S
        todo = self._producers(job)  # producers whose connections are not severed yet
        try:
            while job.live and job.cancel_reason is None:
                waited_s = svc.clock.now() - t0
                for agent, addrs in list(todo.items()):
                    if (job.timed_out or waited_s >= svc.cfg.peer_liveness_timeout_s
                            or self._lost(addrs)):
                        del todo[agent]
                        if not await self._sever(agent, addrs):
                            log.warning("no connection to %s could be torn down: the pull "
                                        "stays quarantined until the transport ends its "
                                        "READ", agent,
                                        extra={"request_id": job.msg.request_id})
                states = await svc.datapath.poll_many(sorted(job.live))
                job.live.difference_update(x for x, s in states.items()
                                           if s.state is not XferState.PENDING)
                if not job.live:
                    break
                await svc.clock.sleep(interval_s)
                interval_s = min(interval_s * 2, QUARANTINE_POLL_S)
                if svc.clock.now() - t0 >= next_log_s:
                    next_log_s += QUARANTINE_LOG_S
                    log.warning("pull quarantined for %.0fs: %d READs not ended by the "
                                "transport; its blocks are not handed back",
                                svc.clock.now() - t0, len(job.live),
                                extra={"request_id": job.msg.request_id})
        finally:
            self.pulls -= 1
            self.nbytes -= nbytes
            svc.metrics.quarantined_pulls.dec()
            svc.metrics.quarantined_bytes.dec(nbytes)
            job.state = state
