"""Several posting workers behind one `Transport`: a pull's READ split by bytes.

Why: one NIXL agent posting from one thread is one stream (one UCX worker, one
``transfer()`` copying inline on cma, one NIC). Measured on a 2-core VM, two agents
in one process, each posting half of a 512 MiB READ from its own thread, moved it
1.3-1.8x faster than one (docs/performance.md); on a real node the same structure is
what uses one NIC per rail (each worker's UCX restricted to its rail's device).

How: `WorkerSet` wraps N transports (own agent, own UCX worker, own prepared lists,
own posting thread); worker 0 is the daemon's agent: its name and metadata are what
the handshake announces, and it alone sends and receives notifications. The other
workers register the same memory and load the same peers, but nobody needs to know
them: a READ is one-sided, so a producer exposes one agent that every consumer
worker reads from. ``post_read`` splits a READ into parts of about equal bytes
(`split_points`: descriptors kept whole, cut between merged runs where one lies near
the ideal cut), posts part 0 on the calling thread and the others on their workers'
threads at once, and returns one composite transfer id. A READ below
``min_part_nbytes * 2`` (every small pull) or carrying a notification goes to worker
0 whole, as with one worker, and keeps worker 0's own id (no wrapper, no hop).

Completion stays per pull: a composite is done when every part is; a part that
failed makes the composite fail once, and only once no other part can still land
(``poll`` reports PENDING until then), so the daemon's quarantine rule (no block
handed back while a READ may land) holds per worker. Every call is made with the
daemon's NIXL lock held (kvd.daemon.datapath), so each agent is used by one thread at
a time: parts fan out to distinct agents, never two threads on one agent.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from kvd.config import MAX_POSTING_WORKERS as MAX_WORKERS
from kvd.errors import TransferError
from kvd.transport.base import (
    DescRows,
    PostPart,
    PostTiming,
    PreppedRead,
    ReadPost,
    Transport,
    TransportCounts,
)
from kvd.transport.remote.prepped import PreppedPoster
from kvd.transport.remote.split import part_of, split_bytes

log = logging.getLogger("kvd.transport")

# Parts smaller than this cost more than they gain: a READ is split into at most
# nbytes // MIN_PART_NBYTES parts, so READs under twice this stay whole (every small
# pull). Measured (`kvd bench split`: one contiguous READ, whole vs 2 parts on 2 workers,
# real NIXL between processes, 4 KiB shm pools, 2-core VM, 3 runs): a split costs a
# fixed ~0.15-0.23 ms (256 KiB READ: 78-95 us whole, 219-315 us split); parts of 512
# KiB lose (0.56-0.72x), 1 MiB too (0.76-0.98x), 2 MiB break even (1.00-1.09x), 3 MiB
# win 1.17-1.18x, 32 MiB 1.54-1.63x. 4 MiB keeps the break-even zone whole with margin,
# and every READ the daemon may post inline on its event loop (<= 4 MiB) stays one.
MIN_PART_NBYTES = 4 << 20
# A part of at most this many descriptors (a cut contiguous pull: one) is posted on a
# fresh list, as the daemon posts such READs (kvd.daemon.pull.movers): NIXL validates a
# few descriptors faster than the poster maps them onto prepared lists, and the part's
# time before its copy starts is the split's cost.
FRESH_PART_MAX_DESCRIPTORS = 8
COMPOSITE_BASE = 1 << 48  # composite transfer ids; worker 0's own ids are far below


@dataclass
class WorkerStats:
    """Per posting worker (per rail where rails are configured), for /metrics."""

    name: str
    rail: str = ""
    reads: int = 0
    nbytes: int = 0


@dataclass
class _Composite:
    """One split READ: (worker, its xfer id or None once released) per part."""

    parts: list[tuple[int, int]]
    done: set[int] = field(default_factory=set)  # part indices ended well
    failed: dict[int, TransferError] = field(default_factory=dict)  # part -> error
    post_error: TransferError | None = None  # a part that could not even be posted


class WorkerSet:
    """A `Transport` over N posting workers (``transports[0]``: the daemon's agent).

    ``rails``: the rail (network device) of each worker, for stats and logs; "" each
    when there are none. ``posting``: the workers a split READ's parts go to (default:
    all); with rails, the per-rail workers, while worker 0 (the daemon's agent, on
    every rail) keeps small READs and notifications.
    """

    def __init__(self, transports: list[Transport], rails: list[str] | None = None,
                 min_part_nbytes: int = MIN_PART_NBYTES,
                 posting: list[int] | None = None) -> None:
        if not transports:
            raise ValueError("WorkerSet needs at least one transport")
        if len(transports) > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} posting workers, got {len(transports)}")
        self.workers = list(transports)
        self.name = transports[0].name
        self.min_part_nbytes = min_part_nbytes
        self.posting = list(range(len(transports))) if posting is None else list(posting)
        if not self.posting or any(not 0 <= w < len(transports) for w in self.posting):
            raise ValueError(f"posting workers {self.posting} not in 0..{len(transports) - 1}")
        rails = rails or [""] * len(transports)
        self.stats = [WorkerStats(t.name, rail) for t, rail in zip(transports, rails,
                                                                     strict=True)]
        self.posters = [PreppedPoster(t) for t in transports]
        # One thread per worker but worker 0, which posts on the caller's thread.
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvd-post{i}")
                         for i in range(1, len(transports))]
        self._regs: dict[int, list[int]] = {}
        # peer -> workers that could not load or post to it (their rail does not reach it)
        self._unusable: dict[str, set[int]] = {}
        self._composites: dict[int, _Composite] = {}
        self._next_id = COMPOSITE_BASE
        self._last_post: PostTiming | None = None
        self._lock = threading.Lock()  # only for the id counter (posts may race polls)

    @property
    def last_post(self) -> PostTiming | None:
        return self._last_post

    def __len__(self) -> int:
        return len(self.workers)

    # ---------------------------------------------------------- memory, peers

    def metadata(self) -> bytes:
        return self.workers[0].metadata()

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        ids: list[int] = []
        try:
            for t in self.workers:
                ids.append(t.register(addr, nbytes, mem_type, device_id))
        except BaseException:
            for t, reg in zip(self.workers, ids, strict=False):
                t.deregister(reg)
            raise
        self._regs[ids[0]] = ids
        return ids[0]

    def deregister(self, reg_id: int) -> None:
        ids = self._regs.pop(reg_id)
        error: TransferError | None = None
        for t, reg in zip(self.workers, ids, strict=True):
            try:
                t.deregister(reg)
            except TransferError as exc:
                error = error or exc
        if error is not None:
            raise error

    def add_peer(self, metadata: bytes) -> str:
        """Worker 0 must load the peer; a worker that cannot (its rail does not reach the
        peer: the peer has no such rail) is left out of that peer's READs."""
        name = self.workers[0].add_peer(metadata)
        self._unusable[name] = set()
        for i, t in enumerate(self.workers[1:], start=1):
            try:
                t.add_peer(metadata)
            except TransferError as exc:
                self._leave_out(name, i, exc)
        return name

    def _leave_out(self, peer: str, worker: int, exc: TransferError) -> None:
        log.warning("posting worker %d (%s) cannot reach %s: its share goes to the others "
                    "(%s)", worker, self.stats[worker].rail or "any device", peer, exc)
        self._unusable.setdefault(peer, set()).add(worker)

    def remove_peer(self, agent_name: str) -> None:
        for poster in self.posters:
            poster.forget_peer(agent_name)
        for t in self.workers:
            t.remove_peer(agent_name)
        self._unusable.pop(agent_name, None)

    def sever_peer(self, agent_name: str, hosts: tuple[str, ...],
                   spare_local_ports: tuple[int, ...] = (),
                   spare_remote_ports: tuple[int, ...] = ()) -> int:
        """Every worker's READs to the peer must become unable to land, not only worker
        0's: a split pull has parts on each. (NIXL's sever works on the process's sockets,
        so the workers after the first usually find nothing left to abort.)"""
        return sum(t.sever_peer(agent_name, hosts, spare_local_ports, spare_remote_ports)
                   for t in self.workers)

    def forget_peer(self, agent_name: str) -> None:
        """Poster interface (kvd.daemon.datapath): drop every worker's lists of a peer."""
        for poster in self.posters:
            poster.forget_peer(agent_name)

    # ---------------------------------------------------------------- posting

    def parts_for(self, post: ReadPost) -> int:
        """How many workers a READ is spread over (1: worker 0 alone, as without workers)."""
        posting = self._posting_for(post.peer)
        if len(posting) <= 1 or post.notif:
            return 1
        total = int(post.nbytes.sum())
        return max(1, min(len(posting), total // self.min_part_nbytes))

    def _posting_for(self, peer: str) -> list[int]:
        """The posting workers that reach a peer (worker 0, on every rail, if none)."""
        unusable = self._unusable.get(peer)
        posting = [w for w in self.posting if not unusable or w not in unusable]
        return posting or [0]

    def prepare(self, post: ReadPost) -> bool:
        """`PreppedPoster.prepare` on worker 0 and every posting worker that reaches the
        peer: those a READ like ``post`` goes to (a part cut inside a descriptor may
        still need a finer chunk of its own)."""
        workers = sorted({0, *self._posting_for(post.peer)})
        return all([self.posters[w].prepare(post) for w in workers])

    def post_read(self, post: ReadPost) -> tuple[int, bool]:
        parts = self.parts_for(post)
        posting = self._posting_for(post.peer)
        if parts == 1 and (post.notif or posting[0] == 0 or
                           int(post.nbytes.sum()) < self.min_part_nbytes):
            xfer_id, done = self.posters[0].post(post)
            self._last_post = self.workers[0].last_post
            self._count(0, post)
            return xfer_id, done
        cuts = split_bytes(post.local_addrs, post.remote_addrs, post.nbytes, parts,
                           self.min_part_nbytes)
        pieces = [part_of(post, lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False)]
        pieces = [replace(p, local_pools=(), remote_pools=())
                  if p.local_pools and len(p.nbytes) <= FRESH_PART_MAX_DESCRIPTORS else p
                  for p in pieces]
        owners = posting[:len(pieces)]
        t0 = time.perf_counter()
        futures = {w: self._threads[w - 1].submit(self.posters[w].post, piece)
                   for w, piece in zip(owners, pieces, strict=True) if w != 0}
        results: list[tuple[int, bool] | TransferError] = []
        for k, (w, piece) in enumerate(zip(owners, pieces, strict=True)):
            try:  # each post returns before this one does
                results.append(self.posters[0].post(piece) if w == 0
                               else futures[w].result())
            except TransferError as exc:
                results.append(exc)
                if w != 0 and self._unreachable(exc):
                    # Nothing of that part was posted: worker 0 (every rail) takes it, and
                    # if it can, that worker sits out this peer's READs from now on.
                    try:
                        results[-1] = self.posters[0].post(piece)
                    except TransferError:
                        continue
                    owners[k] = 0
                    self._leave_out(post.peer, w, exc)
        wall_s = time.perf_counter() - t0
        return self._compose(owners, pieces, results, wall_s)

    @staticmethod
    def _unreachable(exc: TransferError) -> bool:
        """A post refused because the worker's devices do not reach the peer (UCX:
        UNREACHABLE / no route; loopback tests: peer not loaded), not a failed READ."""
        text = str(exc).lower()
        return any(k in text for k in ("unreachable", "not loaded", "no route",
                                       "not_found", "notfound"))

    def _count(self, worker: int, post: ReadPost) -> None:
        s = self.stats[worker]
        s.reads += 1
        s.nbytes += int(post.nbytes.sum())

    def _compose(self, owners: list[int], pieces: list[ReadPost],
                 results: list[tuple[int, bool] | TransferError], wall_s: float
                 ) -> tuple[int, bool]:
        comp = _Composite(parts=[])
        errors: list[TransferError] = []
        build_s = 0.0
        for worker, piece, res in zip(owners, pieces, results, strict=True):
            if isinstance(res, TransferError):
                errors.append(res)
                continue
            xfer_id, done = res
            self._count(worker, piece)
            timing = self.workers[worker].last_post
            build_s += timing.build_s if timing is not None else 0.0
            comp.parts.append((worker, xfer_id))
            if done:
                comp.done.add(len(comp.parts) - 1)
        if not comp.parts:  # nothing posted: nothing can land
            raise errors[0]
        if errors:  # posted parts may still land: fail the composite once they ended
            comp.post_error = errors[0]
        parts = tuple(PostPart(worker, self.stats[worker].rail, len(piece.nbytes),
                               int(piece.nbytes.sum()))
                      for worker, piece, res in zip(owners, pieces, results, strict=True)
                      if not isinstance(res, TransferError))
        self._last_post = PostTiming(descriptors=sum(len(p.nbytes) for p in pieces),
                                     build_s=build_s, transfer_s=max(0.0, wall_s - build_s),
                                     parts=parts)
        with self._lock:
            xfer_id = self._next_id
            self._next_id += 1
        self._composites[xfer_id] = comp
        return xfer_id, not errors and len(comp.done) == len(comp.parts)

    # ---------------------------------------------------------- prepared lists
    # Worker 0's, for callers that prepare lists themselves (benchmarks); the daemon
    # posts through ``post`` and each worker's own PreppedPoster.

    def prepare_local(self, rows: DescRows) -> int:
        return self.workers[0].prepare_local(rows)

    def prepare_remote(self, peer: str, rows: DescRows) -> int:
        return self.workers[0].prepare_remote(peer, rows)

    def release_prepared(self, list_id: int) -> None:
        self.workers[0].release_prepared(list_id)

    def is_prepared(self, list_id: int) -> bool:
        return self.workers[0].is_prepared(list_id)

    def post_prepped_read(self, post: PreppedRead) -> tuple[int, bool]:
        xfer_id, done = self.workers[0].post_prepped_read(post)
        self._last_post = self.workers[0].last_post
        return xfer_id, done

    # --------------------------------------------------------------- progress

    def xfer_descriptors(self, xfer_id: int) -> int | None:
        comp = self._composites.get(xfer_id)
        if comp is None:
            return self.workers[0].xfer_descriptors(xfer_id)
        counts = [self.workers[w].xfer_descriptors(x) for w, x in comp.parts]
        return None if any(c is None for c in counts) else sum(c for c in counts if c)

    def poll(self, xfer_id: int) -> bool:
        """True when every part is done; PENDING (False) while any part may still land,
        even when another has failed; then the first failure, raised (once per poll)."""
        comp = self._composites.get(xfer_id)
        if comp is None:
            return self.workers[0].poll(xfer_id)
        for i, (worker, part_id) in enumerate(comp.parts):
            if i in comp.done or i in comp.failed:
                continue
            try:
                if self.workers[worker].poll(part_id):
                    comp.done.add(i)
            except TransferError as exc:
                comp.failed[i] = exc
        if len(comp.done) + len(comp.failed) < len(comp.parts):
            return False
        if comp.failed:
            raise comp.failed[min(comp.failed)]
        if comp.post_error is not None:
            raise comp.post_error
        return True

    def release(self, xfer_id: int) -> None:
        comp = self._composites.pop(xfer_id, None)
        if comp is None:
            self.workers[0].release(xfer_id)
            return
        for worker, part_id in comp.parts:
            self.workers[worker].release(part_id)

    def notifications(self) -> list[tuple[str, bytes]]:
        return self.workers[0].notifications()

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.workers[0].send_notif(peer, msg)

    def counts(self) -> TransportCounts:
        total = TransportCounts()
        for t in self.workers:
            c = t.counts()
            total.registrations += c.registrations
            total.transfers += c.transfers
            total.peers += c.peers
            total.prepared_lists += c.prepared_lists
        return total

    def close(self) -> None:
        """Poster lists, then every worker (worker 0 last), then the posting threads."""
        for poster in self.posters:
            poster.close()
        for t in reversed(self.workers):
            t.close()
        for pool in self._threads:
            pool.shutdown(wait=True)


class SplitPoster:
    """What kvd.daemon.datapath posts through: a WorkerSet's split, or one PreppedPoster."""

    def __init__(self, workers: WorkerSet) -> None:
        self.workers = workers

    def post(self, post: ReadPost) -> tuple[int, bool]:
        return self.workers.post_read(post)

    def forget_peer(self, peer: str) -> None:
        self.workers.forget_peer(peer)

    def prepare(self, post: ReadPost) -> bool:
        return self.workers.prepare(post)

    def close(self) -> None:
        for poster in self.workers.posters:
            poster.close()


def poster_for(transport: Transport) -> PreppedPoster | SplitPoster:
    """The poster of a transport: splitting over its workers when it has several."""
    if isinstance(transport, WorkerSet):
        return SplitPoster(transport)
    return PreppedPoster(transport)
