"""A progressive pull: reads a request's sealed ranges while its prefill still runs.

A `Pull` with ``progressive`` comes in when the decode engine admits the request,
before the producer has sealed anything. `Progressive` (sans-IO: its record and every
decision, over the table below) watches the producer's daemon (``Watch``: a long poll
answered at each new seal) and reads each newly sealed range as an ordinary pull
(kvd.daemon.pull.machine, with its central planning, acquire and quarantine rules),
one at a time, under the range's own request id (kvd.wire.protocol.range_request_id).
`ProgressiveRunner` carries its actions out.

    watching --start_range--> reading --range_read--> watching
    watching --all_read--> confirming --confirmed--> done
    reading --unsealed--> settling --range_ended--> watching   (read again from 0)
    watching | reading | confirming --fail--> failing --range_ended--> failed
    watching | confirming --fail--> failed        (nothing in flight)

Its rules:

* ranges are read in prompt order, cut at multiples of both engines' block sizes (the
  last one at the prompt's end), so a range fills whole local blocks;
* a higher generation (the producer unsealed: preemption) throws away everything read:
  once the range in flight has ended (its READs can no longer land) every range is
  read again, so no local block mixes two generations;
* the pull is ok only once the producer said *complete* in the generation every range
  was read in (a complete generation is never unsealed) and took our ``done``;
* it is reported only when no range is in flight: a failed range pull has already
  waited for its READs (quarantine), so nothing is written into blocks kvd handed back;
* a failure (the producer's engine aborted or left, no seal within the hold timeout,
  the producer's daemon unreachable, a range that failed in the current generation, a
  cancel from the engine) reports every local block invalid: the decode recomputes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.daemon.transitions import step
from kvd.errors import KvdError, LayoutError, NotFoundError
from kvd.wire import protocol as P

log = logging.getLogger("kvd.progressive")

WATCH_WAIT_S = 1.0  # the longest a Watch waits at the producer before it is answered


class ProgState(enum.Enum):
    WATCHING = "watching"
    READING = "reading"
    SETTLING = "settling"  # unsealed: the range in flight must end before reading again
    CONFIRMING = "confirming"
    FAILING = "failing"  # failed: the range in flight must end first
    DONE = "done"
    FAILED = "failed"


class ProgOn(enum.Enum):
    START_RANGE = "start_range"
    RANGE_READ = "range_read"
    UNSEALED = "unsealed"
    RANGE_ENDED = "range_ended"
    ALL_READ = "all_read"
    CONFIRMED = "confirmed"
    FAIL = "fail"


_S = ProgState
TRANSITIONS: dict[ProgState, dict[ProgOn, ProgState]] = {
    _S.WATCHING: {ProgOn.START_RANGE: _S.READING, ProgOn.ALL_READ: _S.CONFIRMING,
                  ProgOn.FAIL: _S.FAILED, ProgOn.UNSEALED: _S.WATCHING},
    _S.READING: {ProgOn.RANGE_READ: _S.WATCHING, ProgOn.UNSEALED: _S.SETTLING,
                 ProgOn.FAIL: _S.FAILING},
    _S.SETTLING: {ProgOn.RANGE_ENDED: _S.WATCHING, ProgOn.UNSEALED: _S.SETTLING,
                  ProgOn.FAIL: _S.FAILING},
    _S.CONFIRMING: {ProgOn.CONFIRMED: _S.DONE, ProgOn.FAIL: _S.FAILED,
                    ProgOn.UNSEALED: _S.WATCHING},
    _S.FAILING: {ProgOn.RANGE_ENDED: _S.FAILED, ProgOn.FAIL: _S.FAILING,
                 ProgOn.UNSEALED: _S.FAILING},
    _S.DONE: {},
    _S.FAILED: {},
}
TERMINAL = {ProgState.DONE, ProgState.FAILED}


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class StartRange:
    """Pull one range as an ordinary pull."""

    msg: P.Pull
    generation: int
    end: int


@dataclass(frozen=True)
class SendDone:
    """Tell the producer every block of ``generation`` is read (a Watch with done)."""

    generation: int


@dataclass(frozen=True)
class Report:
    event: P.Event
    abandon: bool  # tell the producer we gave up (it stops holding for us, or never
    # starts: an Abandon before the first Seal is remembered)


Action = StartRange | SendDone | Report


# ------------------------------------------------------------------ the record


@dataclass
class Progressive:
    msg: P.Pull
    local_block_tokens: int
    started_s: float
    hold_timeout_s: float
    hybrid: bool = False
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))
    state: ProgState = ProgState.WATCHING
    # what the producer said last
    generation: int = -1
    sealed_tokens: int = -1
    complete: bool = False
    remote_block_ids: list[int] = field(default_factory=list)
    remote_groups: list[list[int]] | None = None
    remote_block_tokens: int = 0
    # what is read, in ``read_generation``: tokens [start_token, read_to)
    read_generation: int = -1
    read_to: int = 0
    in_flight: StartRange | None = None
    ranges: int = 0  # range pulls started (their local request ids count them)
    rereads: int = 0  # generations thrown away
    nbytes: int = 0
    descriptors: int = 0
    deadline_s: float = 0.0  # the next seal is due by then
    error: str = ""
    finished_s: float = 0.0

    def __post_init__(self) -> None:
        n, bs = self.msg.num_tokens, self.local_block_tokens
        if n < 0:
            raise LayoutError("a progressive pull needs num_tokens (the prompt's length)")
        if len(self.msg.request_id) > P.MAX_PROGRESSIVE_ID_CHARS or len(
                self.msg.producer_request_id) > P.MAX_PROGRESSIVE_ID_CHARS:
            raise LayoutError(f"a progressive request id is at most "
                              f"{P.MAX_PROGRESSIVE_ID_CHARS} characters")
        hit = 0 if self.hybrid else -(-n // bs) - len(self.msg.local_block_ids)
        if hit < 0:
            raise LayoutError(f"pull names {len(self.msg.local_block_ids)} local blocks but "
                              f"{n} tokens fill only {-(-n // bs)}")
        self.start_token = hit * bs  # the engine's own prefix hit ends here
        self.read_to = self.start_token
        self.deadline_s = self.started_s + self.hold_timeout_s

    @property
    def key(self) -> tuple[str, str]:
        return (self.msg.engine_id, self.msg.request_id)

    def _to(self, event: ProgOn) -> None:
        self.state = step(TRANSITIONS, self.state, event, "a progressive pull")

    # ------------------------------------------------------------ inputs

    def on_sealed(self, sealed: P.Sealed, now_s: float) -> list[Action]:
        """A Watch's answer."""
        if self.state in TERMINAL:
            return []
        if sealed.state == "ended":
            return self.fail(f"not_found: the producer ended the request ({sealed.error})",
                             now_s)
        if sealed.state == "waiting":
            return self._next(now_s)
        progressed = (sealed.generation, sealed.num_tokens, sealed.state == "complete") != (
            self.generation, self.sealed_tokens, self.complete)
        if progressed:
            self.deadline_s = now_s + self.hold_timeout_s
        if sealed.generation != self.generation and self.generation >= 0:
            self._unsealed()
        self.generation, self.sealed_tokens = sealed.generation, sealed.num_tokens
        self.complete = sealed.state == "complete"
        self.remote_block_ids, self.remote_groups = sealed.block_ids, sealed.group_block_ids
        self.remote_block_tokens = sealed.block_size_tokens
        if self.remote_block_tokens <= 0:
            return self.fail("protocol: the producer named no block size", now_s)
        if self.start_token % self.remote_block_tokens:
            return self.fail(
                f"bad_layout: prefix hit of {self.start_token} tokens ends inside a prefill "
                f"block of {self.remote_block_tokens} tokens", now_s)
        if self.complete and self.sealed_tokens < self.msg.num_tokens:
            return self.fail(f"bad_layout: the producer sealed {self.sealed_tokens} tokens "
                             f"complete, the pull needs {self.msg.num_tokens}", now_s)
        return self._next(now_s)

    def _unsealed(self) -> None:
        """A new generation: what was read is void."""
        self.rereads += 1
        self.read_generation, self.read_to = -1, self.start_token
        if self.state in (ProgState.READING, ProgState.SETTLING, ProgState.CONFIRMING,
                          ProgState.FAILING):
            self._to(ProgOn.UNSEALED)

    def on_range(self, event: P.Event, now_s: float) -> list[Action]:
        """The range pull in flight ended (its READs can no longer land)."""
        ended, self.in_flight = self.in_flight, None
        assert ended is not None
        self.nbytes += event.nbytes
        self.descriptors += event.descriptors
        if self.state is ProgState.FAILING:
            self._to(ProgOn.RANGE_ENDED)
            return [self._report(now_s)]
        if self.state is ProgState.SETTLING:
            self._to(ProgOn.RANGE_ENDED)
            return self._next(now_s)
        self._to(ProgOn.RANGE_READ)
        if not event.ok:
            if ended.generation != self.generation:  # unsealed meanwhile: read again
                return self._next(now_s)
            return self.fail(event.error or "transfer_failed: a range failed", now_s)
        if ended.generation == self.generation:
            self.read_generation, self.read_to = ended.generation, ended.end
        return self._next(now_s)

    def on_confirmed(self, sealed: P.Sealed | None, generation: int, now_s: float
                     ) -> list[Action]:
        """The answer to our ``done`` (None: it could not be delivered)."""
        if self.state is not ProgState.CONFIRMING:
            return []
        if sealed is not None and sealed.state == "ended":
            return self.fail(f"not_found: the producer ended the request ({sealed.error})",
                             now_s)
        if sealed is not None and sealed.generation != generation:
            return self.on_sealed(sealed, now_s)  # cannot happen once complete; safe anyway
        # Every range was read in a generation the producer sealed complete (never unsealed
        # after that): the bytes are right. A lost confirmation only leaves the producer's
        # hold to its lease.
        self._to(ProgOn.CONFIRMED)
        return [self._report(now_s)]

    def due_s(self) -> float | None:
        """When `on_tick` has something to decide (None: nothing until an input comes).
        Past its deadline, a pull that waits for its range in flight to end (settling,
        failing) has nothing to time out: its runner must not wake for it again and again."""
        if self.state in (ProgState.WATCHING, ProgState.READING) and not self.complete:
            return self.deadline_s
        return None

    def on_tick(self, now_s: float) -> list[Action]:
        """The runner's clock: the hold timeout."""
        due_s = self.due_s()
        if due_s is not None and now_s >= due_s:
            return self.fail(f"timeout: no seal from the producer within "
                             f"{self.hold_timeout_s:g}s", now_s)
        return []

    def fail(self, error: str, now_s: float) -> list[Action]:
        if self.state in TERMINAL or self.state is ProgState.FAILING:
            return []
        self.error = self.error or error
        self._to(ProgOn.FAIL)
        if self.state is ProgState.FAILING:
            return []  # reported once the range in flight ends
        return [self._report(now_s)]

    # ------------------------------------------------------------ decisions

    def _next(self, now_s: float) -> list[Action]:
        if self.state is not ProgState.WATCHING or self.generation < 0:
            return []
        n = self.msg.num_tokens
        if self.read_generation == self.generation and self.read_to >= n and self.complete:
            self._to(ProgOn.ALL_READ)
            return [SendDone(self.generation)]
        if self.hybrid:  # every group, the Mamba state too, once complete: one read
            if not self.complete:
                return []
            return [self._start(self.start_token, n)]
        if self.complete:
            end = n
        else:
            unit = math.lcm(self.local_block_tokens, self.remote_block_tokens)
            end = min(self.sealed_tokens, n) // unit * unit
        start = self.read_to if self.read_generation == self.generation else self.start_token
        if end <= start:
            if self.read_generation != self.generation:
                self.read_generation, self.read_to = self.generation, start
            return []
        return [self._start(start, end)]

    def _start(self, start: int, end: int) -> StartRange:
        msg, bl, br = self.msg, self.local_block_tokens, self.remote_block_tokens
        first_local = start // bl - self.start_token // bl
        local = list(msg.local_block_ids[first_local:first_local + -(-(end - start) // bl)])
        remote = list(self.remote_block_ids[start // br:-(-end // br)])
        self.ranges += 1
        rid = P.range_request_id(msg.producer_request_id, self.generation, start, end,
                                 self.nonce)
        if self.hybrid:
            child = P.Pull(engine_id=msg.engine_id, request_id=f"{msg.request_id}"
                           f"{P.RANGE_MARK}{self.ranges}", remote_engine_id=msg.remote_engine_id,
                           remote_address=msg.remote_address,
                           remote_block_ids=list(self.remote_block_ids),
                           local_block_ids=list(msg.local_block_ids), remote_request_id=rid,
                           num_tokens=msg.num_tokens,
                           local_group_block_ids=msg.local_group_block_ids,
                           remote_group_block_ids=self.remote_groups)
        else:
            child = P.Pull(engine_id=msg.engine_id,
                           request_id=f"{msg.request_id}{P.RANGE_MARK}{self.ranges}",
                           remote_engine_id=msg.remote_engine_id,
                           remote_address=msg.remote_address, remote_block_ids=remote,
                           local_block_ids=local, remote_request_id=rid,
                           num_tokens=end - start)
        act = StartRange(child, self.generation, end)
        self.in_flight = act
        self._to(ProgOn.START_RANGE)
        return act

    def _report(self, now_s: float) -> Report:
        self.finished_s = now_s
        msg = self.msg
        ok = self.state is ProgState.DONE
        event = P.Event(kind="done_recving", request_id=msg.request_id, ok=ok,
                        invalid_block_ids=[] if ok else list(msg.local_block_ids),
                        invalid_group_block_ids=[] if ok or msg.local_group_block_ids is None
                        else [list(g) for g in msg.local_group_block_ids],
                        error="" if ok else self.error,
                        nbytes=self.nbytes if ok else 0,
                        duration_s=now_s - self.started_s, descriptors=self.descriptors)
        return Report(event, abandon=not ok)


# ------------------------------------------------------------------ the runner


class _Answer:
    """Stands in for the event hub of a range pull: its outcome goes to the runner."""

    def __init__(self, fn: Callable[[P.Event], None]) -> None:
        self.fn = fn

    def push(self, engine_id: str, event: P.Event) -> None:
        self.fn(event)

    def answer(self, identity: bytes, msg_id: int, event: P.Event) -> None:
        self.fn(event)


class ProgressiveRunner:
    """Carries a `Progressive`'s actions out: its Watches, its range pulls, its report."""

    def __init__(self, prog: Progressive, peers: Any, svc: Any, engine: object,
                 start_range: Callable[[P.Pull, _Answer], None],
                 report: Callable[[Progressive, P.Event], None]) -> None:
        self.prog = prog
        self.peers = peers  # the route's peers: a PeerTable or this daemon's LocalPeers
        self.svc = svc
        # The registration the pull's local blocks belong to. A range starts as a new pull
        # of whatever registration the engine id names then: one that left and registered
        # again (a new pool) never gave this pull those blocks.
        self.engine = engine
        self._start_range = start_range
        self._report = report
        self._inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self._inbox.put_nowait(("cancel", None))

    async def run(self) -> None:
        prog, clock = self.prog, self.svc.clock
        self._watcher = asyncio.ensure_future(self._watch())
        try:
            while prog.state not in TERMINAL:
                due_s = prog.due_s()
                left_s = 60.0 if due_s is None else max(0.0, due_s - clock.now())
                try:
                    kind, value = await clock.wait_for(self._inbox.get(), min(left_s, 60.0))
                except TimeoutError:
                    kind, value = "tick", None
                now = clock.now()
                if kind == "sealed":
                    acts = prog.on_sealed(value, now)
                elif kind == "range":
                    acts = prog.on_range(value, now)
                elif kind == "confirmed":
                    acts = prog.on_confirmed(value[0], value[1], now)
                elif kind == "watch_failed":
                    acts = prog.fail(value, now)
                elif kind == "cancel":
                    acts = prog.fail("cancelled: the engine cancelled the pull", now)
                else:
                    acts = prog.on_tick(now)
                for act in acts:
                    self._do(act)
        finally:
            if self._watcher is not None:
                self._watcher.cancel()

    def _do(self, act: Action) -> None:
        prog = self.prog
        if isinstance(act, StartRange):
            try:
                if self.svc.registry.engines.get(prog.msg.engine_id) is not self.engine:
                    raise NotFoundError(f"engine {prog.msg.engine_id!r} left or registered "
                                        "again since the progressive pull began")
                self._start_range(act.msg, _Answer(
                    lambda ev: self._inbox.put_nowait(("range", ev))))
            except KvdError as exc:  # refused at once: as a failed range
                self._inbox.put_nowait(("range", P.Event(
                    kind="done_recving", request_id=act.msg.request_id, ok=False,
                    error=f"{exc.code}: {exc}")))
        elif isinstance(act, SendDone):
            self.svc.spawn(self._done(act.generation))
        else:
            if act.abandon:
                self.svc.spawn(self._abandon())
            self._report(prog, act.event)

    def _watch_msg(self, generation: int, num_tokens: int, complete: bool,
                   done: bool = False) -> P.Watch:
        prog = self.prog
        return P.Watch(request_id=prog.msg.producer_request_id,
                       producer_engine_id=prog.msg.remote_engine_id,
                       consumer_engine_id=prog.msg.engine_id, generation=generation,
                       num_tokens=num_tokens, complete=complete,
                       wait_s=min(WATCH_WAIT_S, prog.hold_timeout_s), done=done)

    async def _watch(self) -> None:
        """Long polls of the producer's seals, until the pull ends or the request is
        complete (or ended): nothing is sealed after that."""
        prog, cfg = self.prog, self.svc.cfg
        seen: tuple[int, int, bool] = (-1, -1, False)
        while prog.state not in TERMINAL:
            msg = self._watch_msg(*seen)
            try:
                reply = await self.peers.request(prog.msg.remote_address, msg,
                                                 msg.wait_s + cfg.handshake_timeout_s)
            except NotFoundError as exc:
                self._inbox.put_nowait(("watch_failed", f"{exc.code}: {exc}"))
                return
            except KvdError as exc:
                self._inbox.put_nowait(("watch_failed",
                                        f"peer_lost: the producer's daemon did not answer "
                                        f"({exc.code}: {exc})"))
                return
            body = reply.body
            if not isinstance(body, P.Sealed):
                self._inbox.put_nowait(("watch_failed", f"protocol: a Watch answered with "
                                                        f"{type(body).__name__}"))
                return
            self._inbox.put_nowait(("sealed", body))
            if body.state in ("complete", "ended"):
                return
            seen = (body.generation, body.num_tokens, False)

    async def _done(self, generation: int) -> None:
        prog, cfg = self.prog, self.svc.cfg
        try:
            reply = await self.peers.request(
                prog.msg.remote_address,
                self._watch_msg(generation, prog.sealed_tokens, True, done=True),
                cfg.handshake_timeout_s)
            body = reply.body if isinstance(reply.body, P.Sealed) else None
        except KvdError as exc:
            log.info("progressive done not delivered (%s); the lease releases the hold", exc,
                     extra={"request_id": prog.msg.request_id})
            body = None
        self._inbox.put_nowait(("confirmed", (body, generation)))

    async def _abandon(self) -> None:
        msg = self.prog.msg
        try:
            await self.peers.request(msg.remote_address, P.Abandon(
                request_id=msg.producer_request_id, producer_engine_id=msg.remote_engine_id,
                consumer_engine_id=msg.engine_id))
        except KvdError as exc:
            log.info("abandon not delivered (%s); the lease releases the hold", exc,
                     extra={"request_id": msg.request_id})

