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

import numpy as np

from kvd.config import MAX_POSTING_WORKERS as MAX_WORKERS
from kvd.errors import TransferError
from kvd.transport.base import (
    DescRows,
    PostTiming,
    PreppedRead,
    ReadPost,
    Transport,
    TransportCounts,
)
from kvd.transport.prepped import PreppedPoster

log = logging.getLogger("kvd.transport")

# Parts smaller than this are not worth a thread hop (~0.05-0.5 ms on a busy host): a
# READ is split into at most nbytes // MIN_PART_NBYTES parts, so small pulls stay whole.
MIN_PART_NBYTES = 4 << 20
# A cut may move to the nearest boundary between merged runs when that costs at most
# this share of a part's bytes; otherwise it falls between two descriptors of one run.
RUN_CUT_SLACK = 0.125
COMPOSITE_BASE = 1 << 48  # composite transfer ids; worker 0's own ids are far below


def split_points(local_addrs: np.ndarray, remote_addrs: np.ndarray, nbytes: np.ndarray,
                 parts: int, slack: float = RUN_CUT_SLACK) -> list[int]:
    """Descriptor indices where a READ is cut into ``parts`` of about equal bytes.

    Returns ``parts + 1`` ascending indices from 0 to ``len(nbytes)``, distinct, so
    part ``i`` is descriptors ``[cuts[i], cuts[i+1])`` (fewer parts when there are
    fewer descriptors). Descriptors are never cut. A run of descriptors adjacent in
    memory on both sides (one descriptor once NIXL merges it) is cut only when no run
    boundary lies within ``slack`` of a part's bytes of the ideal cut: a READ that is
    one contiguous run (a whole pool) is still split, a fragmented one only between
    runs. Pure: no transport, no clock.
    """
    n = len(nbytes)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [0, n]
    sizes = np.asarray(nbytes, dtype=np.int64)
    ends = np.cumsum(sizes)  # ends[i]: bytes of descriptors [0, i]
    total = int(ends[-1])
    la = np.asarray(local_addrs, dtype=np.int64)
    ra = np.asarray(remote_addrs, dtype=np.int64)
    joined = (la[1:] == la[:-1] + sizes[:-1]) & (ra[1:] == ra[:-1] + sizes[:-1])
    # Cut k (1..n-1) falls before descriptor k; bytes before it: ends[k-1].
    run_cuts = np.flatnonzero(~joined) + 1
    run_bytes = ends[run_cuts - 1]
    tolerance = slack * total / parts
    cuts = [0]
    for p in range(1, parts):
        ideal = total * p / parts
        cut = 0
        if len(run_cuts):
            j = int(np.searchsorted(run_bytes, ideal))
            near = [i for i in (j - 1, j) if 0 <= i < len(run_cuts)]
            best = min(near, key=lambda i: abs(run_bytes[i] - ideal))
            if abs(run_bytes[best] - ideal) <= tolerance:
                cut = int(run_cuts[best])
        if not cut:
            k = int(np.searchsorted(ends, ideal))  # first descriptor ending at/after ideal
            below = k if k >= 1 else 1  # cut before descriptor k: bytes ends[k-1]
            above = k + 1
            cut = min((c for c in (below, above) if 1 <= c <= n - 1),
                      key=lambda c: abs(ends[c - 1] - ideal))
        cut = min(max(cut, cuts[-1] + 1), n - (parts - p))
        cuts.append(cut)
    cuts.append(n)
    return cuts


def _part(post: ReadPost, lo: int, hi: int) -> ReadPost:
    return replace(post, local_addrs=post.local_addrs[lo:hi],
                   remote_addrs=post.remote_addrs[lo:hi], nbytes=post.nbytes[lo:hi],
                   local_devs=None if post.local_devs is None else post.local_devs[lo:hi],
                   remote_devs=None if post.remote_devs is None else post.remote_devs[lo:hi])


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
        name = self.workers[0].add_peer(metadata)
        for i, t in enumerate(self.workers[1:], start=1):
            try:
                t.add_peer(metadata)
            except TransferError:
                for u in self.workers[:i]:
                    u.remove_peer(name)
                raise
        return name

    def remove_peer(self, agent_name: str) -> None:
        for poster in self.posters:
            poster.forget_peer(agent_name)
        for t in self.workers:
            t.remove_peer(agent_name)

    def forget_peer(self, agent_name: str) -> None:
        """Poster interface (kvd.daemon.datapath): drop every worker's lists of a peer."""
        for poster in self.posters:
            poster.forget_peer(agent_name)

    # ---------------------------------------------------------------- posting

    def parts_for(self, post: ReadPost) -> int:
        """How many workers a READ is spread over (1: worker 0 alone, as without workers)."""
        if len(self.posting) == 1 or post.notif:
            return 1
        total = int(post.nbytes.sum())
        return max(1, min(len(self.posting), total // self.min_part_nbytes,
                          len(post.nbytes)))

    def post_read(self, post: ReadPost) -> tuple[int, bool]:
        parts = self.parts_for(post)
        if parts == 1 and (post.notif or self.posting[0] == 0 or
                           int(post.nbytes.sum()) < self.min_part_nbytes):
            xfer_id, done = self.posters[0].post(post)
            self._last_post = self.workers[0].last_post
            self._count(0, post)
            return xfer_id, done
        cuts = split_points(post.local_addrs, post.remote_addrs, post.nbytes, parts)
        pieces = [_part(post, lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False)]
        owners = self.posting[:len(pieces)]
        t0 = time.perf_counter()
        futures = {w: self._threads[w - 1].submit(self.posters[w].post, piece)
                   for w, piece in zip(owners, pieces, strict=True) if w != 0}
        results: list[tuple[int, bool] | TransferError] = []
        for w, piece in zip(owners, pieces, strict=True):  # each post returns before this
            try:
                results.append(self.posters[0].post(piece) if w == 0
                               else futures[w].result())
            except TransferError as exc:
                results.append(exc)
        wall_s = time.perf_counter() - t0
        return self._compose(owners, pieces, results, wall_s)

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
        self._last_post = PostTiming(descriptors=sum(len(p.nbytes) for p in pieces),
                                     build_s=build_s, transfer_s=max(0.0, wall_s - build_s))
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

    def close(self) -> None:
        for poster in self.workers.posters:
            poster.close()


def poster_for(transport: Transport) -> PreppedPoster | SplitPoster:
    """The poster of a transport: splitting over its workers when it has several."""
    if isinstance(transport, WorkerSet):
        return SplitPoster(transport)
    return PreppedPoster(transport)
