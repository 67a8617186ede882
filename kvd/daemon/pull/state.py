"""Every state and every transition of a consumer's pull, as one table; and the small
enums its record keeps (its path, its outcome, what follows a discard).

Nothing else moves a pull: `Pull._to` (kvd.daemon.pull.machine) looks each move up in
``TRANSITIONS`` and raises `BadTransition` for one that is not listed. Tests read the
table, and the diagram in kvd.daemon.pull.consumer's module docstring is drawn from it
(`diagram`; tests/daemon/pull/test_pull_machine.py checks that the two agree).

Every state is what ``kvd status`` shows, and each is true: a pull that failed is
FAILING (or QUARANTINED) from that moment, never still READING. A pull is reported (its
done_recving event) only on entering DONE or FAILED, and only once none of its transfers
can write any more: a failing pull whose transfers still run waits in QUARANTINED.
Finished pulls stay listed (``kvd status``, "finished pulls") for ``FINISHED_KEEP_S``
seconds, at most ``FINISHED_KEEP`` of them.
"""

from __future__ import annotations

import enum

from kvd.daemon.transitions import BadTransition, step

__all__ = ["BadTransition"]  # re-exported: tests and callers catch it from here


class PullState(enum.Enum):
    QUEUED = "queued"
    WAITING_RANKS = "waiting_ranks"  # every rank of the consumer engine registered?
    HANDSHAKING = "handshaking"  # greeting the producer's daemons (cached per engine pair)
    ACQUIRING = "acquiring"  # the Acquire is out, assembled meanwhile; a large pull waits
    READING = "reading"  # transfers posted: polled, the Acquire's replies judged
    DISCARDING = "discarding"  # transfers not to be trusted end, before reading again
    RELEASING = "releasing"  # ok: its transfers are released, then it is reported
    FAILING = "failing"  # failed, nothing can land any more: released, then reported
    QUARANTINED = "quarantined"  # failed, but a transfer may still land: not reported yet
    DONE = "done"
    FAILED = "failed"


class On(enum.Enum):
    """What happened to a pull."""

    EARLY_ACQUIRE = "early_acquire"  # handshake cached: the Acquire leaves with the Pull
    WAIT_RANKS = "wait_ranks"
    HANDSHAKE = "handshake"
    ACQUIRE = "acquire"
    POST = "post"  # transfers posted (early, after the replies, or to read again)
    DISCARD = "discard"  # posted too early, or to a stale handshake: let them end first
    STALE = "stale"  # the Acquire's replies name another incarnation or epoch: greet again
    FINISH = "finish"  # every transfer done, every Acquire reply good
    QUARANTINE = "quarantine"  # failing with transfers still running
    FAIL = "fail"  # failed (or cancelled) with nothing running any more
    RELEASED = "released"  # every transfer released, the pools unpinned: reported


class Path(enum.StrEnum):
    """Which mover carries a pull's bytes: in ``kvd status``, the logs and the metrics'
    labels (a str, so it is its own label)."""

    REMOTE = "remote"  # NIXL READs from another daemon's agent
    LOCAL = "local"  # a copy between this daemon's own pools
    HOST = "host"  # a copy out of another same-host daemon's mapped pool files


class Outcome(enum.StrEnum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"  # the daemon stops: failed without waiting for any transfer


class Then(enum.Enum):
    """What follows a discard (the transfers posted ended and were released)."""

    READ_AGAIN = "read_again"  # the READs may predate the publish: the same ones again
    GREET_AGAIN = "greet_again"  # the handshake is stale: a new one, a new Acquire


S = PullState
LIVE = (S.QUEUED, S.WAITING_RANKS, S.HANDSHAKING, S.ACQUIRING, S.READING, S.DISCARDING)
ENDING = (S.RELEASING, S.FAILING, S.QUARANTINED)
TERMINAL = (S.DONE, S.FAILED)

TRANSITIONS: dict[PullState, dict[On, PullState]] = {
    S.QUEUED: {On.EARLY_ACQUIRE: S.ACQUIRING, On.WAIT_RANKS: S.WAITING_RANKS},
    S.WAITING_RANKS: {On.HANDSHAKE: S.HANDSHAKING},
    S.HANDSHAKING: {On.ACQUIRE: S.ACQUIRING},
    S.ACQUIRING: {On.POST: S.READING, On.STALE: S.WAITING_RANKS, On.FINISH: S.RELEASING},
    S.READING: {On.DISCARD: S.DISCARDING, On.STALE: S.WAITING_RANKS,
                On.FINISH: S.RELEASING, On.QUARANTINE: S.QUARANTINED},
    S.DISCARDING: {On.POST: S.READING, On.STALE: S.WAITING_RANKS,
                   On.QUARANTINE: S.QUARANTINED},
    S.RELEASING: {On.RELEASED: S.DONE},
    S.FAILING: {On.RELEASED: S.FAILED},
    S.QUARANTINED: {On.FAIL: S.FAILING},
    S.DONE: {},
    S.FAILED: {},
}
# Failing is possible from every live state: at once when nothing can land any more,
# else through QUARANTINED (only where transfers exist: READING, DISCARDING).
for _state in LIVE:
    TRANSITIONS[_state][On.FAIL] = S.FAILING

FINISHED_KEEP = 64  # finished pulls listed by `kvd status`
FINISHED_KEEP_S = 30.0


def next_state(state: PullState, event: On) -> PullState:
    """Raises kvd.daemon.transitions.BadTransition for a move the table does not list."""
    return step(TRANSITIONS, state, event, "a pull")


def diagram() -> str:
    """The table as lines ``state --event--> state``, in the table's order."""
    return "\n".join(f"{s.value} --{e.value}--> {t.value}"
                     for s, moves in TRANSITIONS.items() for e, t in moves.items())
