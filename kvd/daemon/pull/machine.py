"""One pull, as a sans-IO object: its record, and every decision about it.

`Pull` owns everything known about one consumer pull and changes its own state only
through the table in kvd.daemon.pull.state. It has one entry point, `Pull.handle`: it
takes what happened (an input of kvd.daemon.pull.inputs: the handshake, the assembled
transfers, their post results, the Acquire's replies, a poll, a probe's answer, a lease
renewal's answer, the deadline, a failure) with the time, and returns what to do next,
as `Action` values. It never waits, never calls a socket or NIXL, imports nothing that
does, and reads time only from the ``now_s`` it is given. kvd.daemon.pull.driver carries
the actions out (inline in the engine's request while nothing needs waiting, then in the
pull's task, on the same object) and feeds what happened back; a simulator or a unit
test can drive it as well.

The rules it keeps:

* nothing read is trusted before every Acquire reply is in and judged
  (kvd.daemon.pull.acquire); a refused Acquire fails the pull, a stale handshake makes
  it greet again (twice at most), a READ that may predate the publish is read again;
* a pull is reported only once none of its transfers can land any more: a failing pull
  with transfers still running is QUARANTINED, and the producers they read from are
  severed at once past the deadline or when their control connection is lost, else
  after ``peer_liveness_timeout_s``;
* a host-path pull (a copy from another daemon's mapped pool files, which never fails
  by itself) is ok only if, once every copy ended, the daemon incarnation owning those
  files is still alive (`Confirm`): else a successor may have adopted them and its
  engine reused the blocks under the copy;
* a failed pull reports every local block invalid, never ok with wrong bytes; its
  producers are told to stop holding (abandon), an ok pull's producers get their READ
  notices, both only after the engine has its answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvd.daemon.engines.table import EngineRank
from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.acquire import Replies, may_predate_publish, receipted
from kvd.daemon.pull.actions import (  # the steps' return values; re-exported here
    Action,
    Assemble,
    AwaitReplies,
    Confirm,
    Discard,
    ForgetHandshake,
    Greet,
    KeepLeases,
    Notice,
    PollAfter,
    Post,
    Probe,
    Quarantine,
    Release,
    Report,
    SendAcquire,
    Sever,
    WaitRanks,
    Warn,
)
from kvd.daemon.pull.inputs import (
    AcquireSent,
    Assembled,
    AssemblyFailed,
    Begin,
    Confirmed,
    Discarded,
    Greeted,
    Input,
    Interrupted,
    LeaseReply,
    Polled,
    Posted,
    Probed,
    Raised,
    RanksReady,
    Released,
    RepliesIn,
)
from kvd.daemon.pull.state import On, Outcome, Path, PullState, Then, next_state
from kvd.errors import DrainingError, KvdError, PeerLostError, TransferError
from kvd.transport.base import PostResult, ReadPost, XferState, XferStatus
from kvd.wire import protocol as P

# READ completion polling: SPIN_POLLS polls a loop turn apart, then from FIRST_POLL_S
# doubling to MAX_POLL_S (a 1-block pull completes in well under a millisecond; a
# multi-GiB one takes seconds).
FIRST_POLL_S = 0.0001
MAX_POLL_S = 0.002
SPIN_POLLS = 8
QUARANTINE_POLL_S = 0.05  # a failing pull's transfers, polled until the transport ends them
QUARANTINE_LOG_S = 10.0
# Pulls of at most this many bytes post their READs before the Acquire's reply comes.
EARLY_POST_MAX_BYTES = 4 << 20
# A producer that no longer holds our request (or restarted) fails the pull only if the
# READ from it is still pending this long after: a producer releases the hold when our
# READ's notice arrives, which may be a moment before we see the READ done ourselves.
LOST_GRACE_S = 0.05
GREETINGS = 2  # handshakes a pull may go through (the cached one counts) before failing

# ------------------------------------------------------------------ the pull


@dataclass
class Pull:
    msg: P.Pull
    started_s: float
    reply_to: tuple[bytes, int] | None = None  # (identity, request id): answer when done
    path: Path = Path.REMOTE  # which mover carries it
    liveness_timeout_s: float = 10.0  # producers of a quarantined pull severed after it
    transfer_timeout_s: float = 60.0
    state: PullState = PullState.QUEUED
    remote: RemoteEngine | None = None  # the handshake the pull works with
    posts: tuple[ReadPost, ...] = ()
    notices: tuple[Notice, ...] = ()
    nbytes: int = 0
    descriptors: int = 0
    replies: Replies | None = None
    acquired: list[str] = field(default_factory=list)  # producer daemons holding it for us
    handles: list[int] = field(default_factory=list)  # transfer handles not released
    live: set[int] = field(default_factory=set)  # posted, not yet ended by the transport
    reading_from: dict[int, str] = field(default_factory=dict)  # pending handle -> agent
    pinned: list[EngineRank] = field(default_factory=list)
    lost: dict[str, tuple[float, PeerLostError]] = field(default_factory=dict)  # by agent
    posted_s: float = 0.0
    # per post: (seconds, descriptors, PostTiming per READ), for the metrics once reported
    post_records: list[tuple[float, int, list[Any]]] = field(default_factory=list)
    timed_out: bool = False
    cancel_reason: KvdError | None = None  # why the daemon stops the pull (draining)
    outcome: Outcome | None = None  # None while running
    error: str = ""
    greetings_left: int = GREETINGS
    finished_s: float = 0.0
    _post_errors: list[TransferError] = field(default_factory=list)
    _failure: str = ""  # an assembly failure, reported once the replies say who holds it
    _then: Then | None = None  # what follows the discard (DISCARDING)
    _leases_kept: bool = False  # KeepLeases returned
    _regreeted: bool = False  # greeted once more after a handshake with retired mappings
    _probing: list[str] = field(default_factory=list)  # producer daemons left to probe
    _probe_error: TransferError | None = None  # the failure the probes explain, or not
    _polls: int = 0
    _poll_s: float = FIRST_POLL_S
    _quarantined_s: float = 0.0
    _next_warn_s: float = 0.0
    _severed: set[str] = field(default_factory=set)
    _stepped_s: float | None = None  # the read phase's last step (`_stalled`)
    _stall: str = ""  # a stall seen while discarding: the pull fails once that ends
    # Traced pulls only (kvd.ops.otel builds their spans once reported): each transition
    # and the Acquire's replies, with the time from ``marks_clock``; None: not kept.
    marks: list[tuple[str, float]] | None = None
    marks_clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        if type(self.path) is not Path:  # its name (an enum lookup costs a microsecond)
            self.path = Path(self.path)

    @property
    def key(self) -> tuple[str, str]:
        return (self.msg.engine_id, self.msg.request_id)

    @property
    def ending(self) -> bool:
        return self.outcome is not None

    def _to(self, event: On) -> None:
        self.state = next_state(self.state, event)
        if self.marks is not None:
            self._mark(event.value)

    def _mark(self, name: str) -> None:
        if self.marks is not None:
            self.marks.append((name, self.marks_clock()))  # type: ignore[misc]

    # ------------------------------------------------------------ the entry point

    def handle(self, event: Input, now_s: float) -> list[Action]:
        """What happened, at ``now_s`` (the clock's time): the actions that follow. (One
        table lookup by the input's type: this runs on every step of every pull.)"""
        return _ON[type(event)](self, event, now_s)

    def _on_begin(self, e: Begin, now_s: float) -> list[Action]:
        if e.cached is None or e.path is None:  # no mover for it: greet afresh
            return self.begin(None)
        self.path = e.path
        return self.begin(e.cached)

    def _on_ranks(self, e: RanksReady, now_s: float) -> list[Action]:
        if e.again:
            # It left and registered again (greeting again, or waiting for its ranks): the
            # pull's blocks are the old registration's, not the new pool's.
            return self.fail(f"{KvdError.code}: engine {self.msg.engine_id!r} registered "
                             "again during the pull", now_s)
        return self.ranks_ready()

    def _on_greeted(self, e: Greeted, now_s: float) -> list[Action]:
        if e.path is not None:
            self.path = e.path
            return self.greeted(e.remote)
        if self._regreeted:
            return self.fail(f"{KvdError.code}: engine {self.msg.remote_engine_id!r}: its "
                             "pools keep being freed", now_s)
        self._regreeted = True  # its producer freed a pool meanwhile: once more
        return [ForgetHandshake(), Greet()]

    def _on_acquire_sent(self, e: AcquireSent, now_s: float) -> list[Action]:
        self.acquire_sent(now_s)
        return []

    def _on_interrupted(self, e: Interrupted, now_s: float) -> list[Action]:
        if e.deadline and self.cancel_reason is None:
            return self.on_deadline(now_s)
        return self.cancel(self.cancel_reason or DrainingError(
            "pull cancelled (engine gone or daemon stopping)"))

    def _on_lease_reply(self, e: LeaseReply, now_s: float) -> list[Action]:
        self.on_lease_reply(e.address, e.reply, now_s)
        return []

    # ------------------------------------------------------------ setting out

    def begin(self, cached: RemoteEngine | None) -> list[Action]:
        """With a cached handshake (and every rank of the engine registered) the Acquire
        leaves with the Pull, before anything else; else wait for the ranks first."""
        if cached is not None:
            self._to(On.EARLY_ACQUIRE)
            self.remote = cached
            return [SendAcquire(), Assemble()]
        self._to(On.WAIT_RANKS)
        return [WaitRanks()]

    def ranks_ready(self) -> list[Action]:
        self._to(On.HANDSHAKE)
        return [Greet()]

    def greeted(self, remote: RemoteEngine) -> list[Action]:
        self._to(On.ACQUIRE)
        self.remote = remote
        return [SendAcquire(), Assemble()]

    def assembled(self, posts: list[ReadPost], notices: list[Notice], nbytes: int,
                  descriptors: int, answered: bool) -> list[Action]:
        """The pull's transfers (one per producer daemon with descriptors) and notices (one
        per producer daemon). A small one (or one whose publish receipt rules out a
        read-again) is posted before the Acquire's replies come; the rest waits for them
        (still ACQUIRING)."""
        self.posts, self.notices = tuple(posts), tuple(notices)
        self.nbytes, self.descriptors = nbytes, descriptors
        if posts and not answered and self.posts_early():
            return [Post(self.posts)]
        return [AwaitReplies()]

    def assembly_failed(self, error: str) -> list[Action]:
        """The descriptors could not be planned: fail once the replies say who holds the
        request for us (those are told to stop)."""
        self._failure = error
        return [AwaitReplies()]

    def posts_early(self) -> bool:
        """The early post saves up to a round trip, which is most of a small pull; a
        read-again (a young hold) costs a whole READ."""
        assert self.remote is not None
        daemons = self.remote.daemons
        return self.nbytes <= EARLY_POST_MAX_BYTES or all(
            receipted(self.msg, daemons, p.peer) for p in self.posts)

    # ------------------------------------------------------------ transfers

    def posted(self, results: list[PostResult], posted_s: float, post_s: float
               ) -> list[Action]:
        """The transfers' handles (done ones are released already). Post errors are judged
        once the replies are: a refused Acquire explains a failed READ better."""
        self._to(On.POST)
        self.posted_s = posted_s
        self._stepped_s = posted_s + post_s  # a large post itself may take a while
        self.handles = [r.xfer_id for r in results if r.xfer_id is not None]
        self.live = set(self.handles)
        self.reading_from = {r.xfer_id: p.peer for p, r in zip(self.posts, results, strict=True)
                             if r.xfer_id is not None and not r.done}
        self._post_errors = [r.error for r in results if r.error is not None]
        self.post_records.append((post_s, self.descriptors, [r.timing for r in results]))
        self._polls, self._poll_s = 0, FIRST_POLL_S
        if self.replies is None:
            return [AwaitReplies()]
        return self._judge_reads()

    def _judge_reads(self) -> list[Action]:
        if self._post_errors:
            return self._probe(self._post_errors[0])
        return self._poll_or_finish()

    def _probe(self, error: TransferError) -> list[Action]:
        """Drop the cached producer daemons; then ask each, in order, whether it is still
        the incarnation we greeted, up to the first that is not (`on_probe_answer`)."""
        assert self.remote is not None
        first, *self._probing = self.remote.daemons
        self._probe_error = error
        return [Probe(first, error, drop=tuple(self.remote.daemons))]

    def _poll_or_finish(self) -> list[Action]:
        if self.reading_from:
            return [*self._keep_leases(), PollAfter(self._next_poll_s())]
        if self.path is Path.HOST:
            return [Confirm()]
        return self._end(Outcome.OK, "")

    def confirmed(self, gone: str, now_s: float) -> list[Action]:
        """The answer to `Confirm`: "" when the producer's incarnation outlived every copy,
        else why not (the pull fails: its bytes may be another request's)."""
        if gone:
            return self.fail(f"{PeerLostError.code}: {gone}", now_s)
        return self._end(Outcome.OK, "")

    def _next_poll_s(self) -> float:
        if self._polls < SPIN_POLLS:  # a small READ ends within a few loop turns
            self._polls += 1
            return 0.0
        delay_s = self._poll_s
        self._poll_s = min(self._poll_s * 2, MAX_POLL_S)
        return delay_s

    def on_poll(self, states: Mapping[int, XferStatus], now_s: float,
                unreachable: frozenset[str] = frozenset()) -> list[Action]:
        """States of the transfers polled; ``unreachable``: producer daemon addresses whose
        control connection liveness lost (dead, partitioned or frozen)."""
        self.live.difference_update(x for x, s in states.items()
                                    if s.state is not XferState.PENDING)
        if self.state is PullState.QUARANTINED:
            return self._quarantine_step(now_s, unreachable)
        stall = self._stalled(now_s)
        if self.state is PullState.DISCARDING:  # only their end matters
            self._stall = self._stall or stall
            return [*self._keep_leases(),
                    PollAfter(self._discard_poll_s()) if self.live else Discard()]
        if stall:
            return self.fail(stall, now_s)
        failed = [s.error for s in states.values() if s.error is not None]
        if failed:
            return self._probe(failed[0])
        self.reading_from = {x: a for x, a in self.reading_from.items()
                             if states.get(x, XferStatus(XferState.PENDING)).state
                             is XferState.PENDING}
        reading = set(self.reading_from.values())
        for agent, (since_s, exc) in self.lost.items():
            if agent in reading and now_s - since_s >= LOST_GRACE_S:
                return self.fail(f"{exc.code}: {exc}", now_s)
        assert self.remote is not None
        for addr, known in self.remote.daemons.items():
            if known.agent in reading and addr in unreachable:
                exc = PeerLostError(f"producer daemon {addr} is unreachable: its control "
                                    "connection was lost mid-READ (peer_liveness_timeout_s)")
                return self.fail(f"{exc.code}: {exc}", now_s)
        return self._poll_or_finish()

    def on_probe_answer(self, address: str, reply: Reply | None, now_s: float
                        ) -> list[Action]:
        """One producer daemon's answer to the probe (None: unreachable): the first that is
        lost or restarted names the failure; when every one answered as greeted, the
        transfer error itself does."""
        assert self.remote is not None and self._probe_error is not None
        error = self._probe_error
        exc: KvdError = error
        if reply is None:
            exc = PeerLostError(f"producer daemon {address} is unreachable after a failed "
                                f"READ ({error})")
        elif reply.instance != self.remote.daemons[address].instance:
            exc = PeerLostError(f"producer daemon {address} restarted during the pull "
                                f"({error})")
        elif self._probing:
            return [Probe(self._probing.pop(0), error)]
        self._probing = []
        return self.fail(f"{exc.code}: {exc}", now_s)

    def on_probed(self, error: TransferError, answers: Mapping[str, Reply | None],
                  now_s: float) -> list[Action]:
        """The answers to the probes at once, in order (as `on_probe_answer` one by one)."""
        self._probe_error = error
        items = list(answers.items())
        acts: list[Action] = []
        for i, (addr, reply) in enumerate(items):
            self._probing = [a for a, _ in items[i + 1:]]
            acts = self.on_probe_answer(addr, reply, now_s)
            if self.ending:
                break
        return acts

    # ------------------------------------------------------------ the Acquire

    def on_replies(self, addresses: list[str], got: list[Reply | BaseException],
                   now_s: float) -> list[Action]:
        """Every reply to the Acquire (or the error in its place), in address order."""
        self._mark("replies")
        self.acquired = [a for a, r in zip(addresses, got, strict=True)
                         if not isinstance(r, BaseException)]
        errors = [r for r in got if isinstance(r, BaseException)]
        if errors:
            return self.fail(self.describe(errors[0]), now_s)
        self.replies = Replies(dict(zip(addresses, got, strict=True)))  # type: ignore[arg-type]
        assert self.remote is not None
        if self._failure:
            return self.fail(self._failure, now_s)
        stall = self._stalled(now_s)
        if stall:
            return self.fail(stall, now_s)
        if not self.replies.current(self.remote.daemons):
            # A producer daemon restarted, or its pools changed, since we cached this.
            if self.handles:
                return self._discard(Then.GREET_AGAIN)
            return self._greet_again(now_s)
        if self.state is PullState.ACQUIRING:  # nothing posted yet
            if not self.posts:  # nothing to read here: the notices only
                return self._end(Outcome.OK, "")
            return [Post(self.posts)]
        if any(may_predate_publish(self.msg, self.remote.daemons, self.replies, p.peer,
                                   self.posted_s) for p in self.posts):
            # Common when the Pull follows its Publish within a round trip (a benchmark);
            # rare in service, where the prefill's answer goes through the router first.
            # The first READs must end before new ones go out (leases kept alive meanwhile).
            return [Warn("READ posted before the request's hold was seen to be older: "
                         "reading again"), *self._discard(Then.READ_AGAIN)]
        return self._judge_reads()

    def _discard(self, then: Then) -> list[Action]:
        """Let every transfer posted end (polled), then release them (`Discard`)."""
        self._to(On.DISCARD)
        self._then = then
        return [*self._keep_leases(), PollAfter(0.0) if self.live else Discard()]

    def discarded(self, now_s: float) -> list[Action]:
        """The discarded transfers ended and were released, the pools unpinned."""
        then, self._then = self._then, None
        self.handles, self.live, self.reading_from = [], set(), {}
        if self._stall:
            return self.fail(self._stall, now_s)
        if then is Then.READ_AGAIN:
            return [Post(self.posts, again=True)]
        return self._greet_again(now_s)

    def _greet_again(self, now_s: float) -> list[Action]:
        self.greetings_left -= 1
        if self.greetings_left <= 0:
            return self.fail(f"{KvdError.code}: engine {self.msg.remote_engine_id!r} keeps "
                             "changing its pools or daemons", now_s)
        self._to(On.STALE)
        self.replies, self.posts, self.notices, self.acquired = None, (), (), []
        self._stepped_s = None  # a new handshake and Acquire: a new read phase
        return [ForgetHandshake(), WaitRanks()]

    # ------------------------------------------------------------ leases

    @property
    def renewing(self) -> bool:
        """Whether the producers' leases need renewing: transfers run (or a discarded one
        ends before a read-again), a big READ can outlast a lease."""
        return (self.state in (PullState.READING, PullState.DISCARDING)
                and bool(self.reading_from))

    def _keep_leases(self) -> list[Action]:
        """`KeepLeases`, once: when transfers first run (or end before a read-again)."""
        if self._leases_kept or not self.renewing:
            return []
        self._leases_kept = True
        return [KeepLeases()]

    def lease_addresses(self) -> list[str]:
        """Producer daemons holding a READ of ours still pending (and not lost); none
        while the leases need no renewing."""
        if self.remote is None or not self.renewing:
            return []
        reading = set(self.reading_from.values())
        return [a for a, d in self.remote.daemons.items()
                if d.agent in reading and d.agent not in self.lost]

    def on_lease_reply(self, address: str, reply: Reply, now_s: float) -> None:
        assert self.remote is not None
        known = self.remote.daemons.get(address)
        if known is None:
            return
        if reply.instance != known.instance:
            self.lost[known.agent] = (now_s, PeerLostError(
                f"producer daemon {address} restarted during the pull"))
        elif reply.body.unknown:
            self.lost[known.agent] = (now_s, PeerLostError(
                f"producer daemon {address} no longer holds request "
                f"{self.msg.producer_request_id!r} (lease expired?)"))

    # ------------------------------------------------------------ the end

    def describe(self, exc: BaseException) -> str:
        """How a failure reads in the pull's event: its code first."""
        if isinstance(exc, KvdError):  # before TimeoutError: a KvdTimeoutError keeps its own
            return f"{exc.code}: {exc}"
        if isinstance(exc, TimeoutError):
            return f"timeout: pull timed out after {self.transfer_timeout_s}s"
        return f"internal: {exc!r}"

    def on_deadline(self, now_s: float) -> list[Action]:
        self.timed_out = True
        return self.fail(f"timeout: pull timed out after {self.transfer_timeout_s}s", now_s)

    def cancel(self, reason: KvdError) -> list[Action]:
        """The daemon stops (drain timeout): fail without waiting for any transfer (the
        NIXL agent and every endpoint go with the daemon)."""
        self.cancel_reason = reason
        if self.ending:
            self.live.clear()
            if self.state is PullState.QUARANTINED:
                self._to(On.FAIL)
                return [Quarantine(False, self.nbytes), Release()]
            return [Release()]
        return self._end(Outcome.CANCELLED, f"{reason.code}: {reason}")

    def fail(self, error: str, now_s: float) -> list[Action]:
        """Fail the pull: at once when no transfer of it can land any more, else through
        QUARANTINED until the transport ended each (`on_poll`)."""
        if self.ending:
            return []
        return self._end(Outcome.FAILED, error, now_s)

    def _end(self, outcome: Outcome, error: str, now_s: float | None = None
             ) -> list[Action]:
        self.outcome, self.error = outcome, error
        self._mark("end")
        self._then = None
        if outcome is not Outcome.CANCELLED and self.live:
            # Only a failure quarantines, and every failure passes the clock's time: the
            # wait before severing counts from now, never from the clock's zero.
            assert now_s is not None, "a pull quarantined without the time"
            self._to(On.QUARANTINE)
            self._quarantined_s = self._next_warn_s = now_s
            self._next_warn_s += QUARANTINE_LOG_S
            self._poll_s = FIRST_POLL_S
            return [Quarantine(True, self.nbytes), *self._quarantine_step(now_s,
                                                                          frozenset())]
        self._to(On.FINISH if outcome is Outcome.OK else On.FAIL)
        return [Release()]

    def acquire_sent(self, now_s: float) -> None:
        """The Acquire left (the driver says when): its reply is due within
        ``liveness_timeout_s``, like every later step of the read phase (`_stalled`)."""
        if self._stepped_s is None:
            self._stepped_s = now_s

    def _stalled(self, now_s: float) -> str:
        """Why nothing read can be trusted, when this pull was not stepped for more than
        ``liveness_timeout_s`` since its last step of the read phase (polls come
        milliseconds apart; an Acquire's reply within that, or liveness loses its
        connection): its daemon stalled (frozen, a stuck loop), no heartbeat renewed the
        producers' leases meanwhile, and a hold may have ended under our READ, its blocks
        reused by their engine. A producer that stalled moves its leases on instead
        (kvd.daemon.produce.producer.Producer.expire). Not for a local pull: its producer
        is this very daemon, stalled with it, and moved its leases on by the same gap."""
        last, self._stepped_s = self._stepped_s, now_s
        if (self.path is Path.LOCAL or last is None
                or now_s - last <= self.liveness_timeout_s):
            return ""
        return (f"{PeerLostError.code}: this daemon stalled {now_s - last:.1f}s during the "
                "pull, no lease renewed meanwhile: the producers' holds may have ended")

    def _producers(self) -> dict[str, tuple[str, ...]]:
        """Agent -> control addresses of the producers a live transfer reads from."""
        if self.remote is None:
            return {}
        agents = {self.reading_from.get(x) for x in self.live}
        if None in agents:  # a transfer whose producer is not noted (a discarded one): all
            agents = {d.agent for d in self.remote.daemons.values()}
        out: dict[str, list[str]] = {}
        for addr, d in self.remote.daemons.items():
            if d.agent in agents:
                out.setdefault(d.agent, []).append(addr)
        return {a: tuple(addrs) for a, addrs in out.items()}

    def _quarantine_step(self, now_s: float, unreachable: frozenset[str]) -> list[Action]:
        if not self.live or self.cancel_reason is not None:
            self._to(On.FAIL)
            return [Quarantine(False, self.nbytes), Release()]
        waited_s = now_s - self._quarantined_s
        due = {agent: addrs for agent, addrs in self._producers().items()
               if agent not in self._severed and (
                   self.timed_out or waited_s >= self.liveness_timeout_s
                   or any(a in unreachable for a in addrs))}
        self._severed.update(due)
        out: list[Action] = [Sever(due)] if due else []
        if now_s >= self._next_warn_s:
            self._next_warn_s += QUARANTINE_LOG_S
            out.append(Warn(f"pull quarantined for {waited_s:.0f}s: {len(self.live)} "
                            "transfers not ended by the transport; its blocks are not handed "
                            "back"))
        out.append(PollAfter(self._discard_poll_s(QUARANTINE_POLL_S)))
        return out

    def _discard_poll_s(self, cap_s: float = MAX_POLL_S) -> float:
        delay_s = self._poll_s
        self._poll_s = min(self._poll_s * 2, cap_s)
        return delay_s

    def released(self, now_s: float) -> list[Action]:
        """Every handle released and the pools unpinned: report."""
        self._to(On.RELEASED)
        self.finished_s = now_s
        ok = self.outcome is Outcome.OK
        msg = self.msg
        event = P.Event(
            kind="done_recving", request_id=msg.request_id, ok=ok,
            invalid_block_ids=[] if ok else list(msg.local_block_ids), error=self.error,
            nbytes=self.nbytes if ok else 0, duration_s=now_s - self.started_s,
            invalid_group_block_ids=[] if ok else list(msg.local_group_block_ids or []),
            descriptors=self.descriptors)
        return [Report(event, self.notices if ok else (),
                       () if ok else tuple(self.acquired))]


_ON: dict[type, Any] = {  # `Pull.handle`: each input to its step
    Begin: Pull._on_begin,
    RanksReady: Pull._on_ranks,
    Greeted: Pull._on_greeted,
    AcquireSent: Pull._on_acquire_sent,
    Assembled: lambda p, e, now_s: p.assembled(e.posts, e.notices, e.nbytes, e.descriptors,
                                               e.answered),
    AssemblyFailed: lambda p, e, now_s: p.assembly_failed(e.error),
    Posted: lambda p, e, now_s: p.posted(e.results, e.posted_s, e.post_s),
    RepliesIn: lambda p, e, now_s: p.on_replies(e.addresses, e.got, now_s),
    Polled: lambda p, e, now_s: p.on_poll(e.states, now_s, e.unreachable),
    Probed: lambda p, e, now_s: p.on_probe_answer(e.address, e.reply, now_s),
    Confirmed: lambda p, e, now_s: p.confirmed(e.gone, now_s),
    Discarded: lambda p, e, now_s: p.discarded(now_s),
    Released: lambda p, e, now_s: p.released(now_s),
    LeaseReply: Pull._on_lease_reply,
    Interrupted: Pull._on_interrupted,
    Raised: lambda p, e, now_s: p.fail(p.describe(e.error), now_s),
}
