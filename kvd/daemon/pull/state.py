"""Every state and every transition of a consumer's pull, as one table.

Nothing else moves a pull: `Pull._to` (kvd.daemon.pull.machine) looks each move up in
``TRANSITIONS`` and raises `BadTransition` for one that is not listed. Tests read the
table, and the diagram in kvd.daemon.pull.consumer's docstring is drawn from it (`diagram`;
tests/daemon/pull/test_pull_machine.py checks that the two agree).

A pull is reported (its done_recving event) only on entering DONE or FAILED, and only
once none of its transfers can write any more: a failing pull whose transfers still run
waits in QUARANTINED. Finished pulls stay listed (``kvd status``, "finished pulls") for
``FINISHED_KEEP_S`` seconds, at most ``FINISHED_KEEP`` of them.
"""

from __future__ import annotations

import enum

from kvd.daemon.transitions import BadTransition, step

__all__ = ["BadTransition"]  # re-exported: tests and callers catch it from here


class PullState(enum.Enum):
    QUEUED = "queued"
    WAITING_RANKS = "waiting_ranks"  # every rank of the consumer engine registered?
    HANDSHAKING = "handshaking"  # greeting the producer's daemons (cached per engine pair)
    ACQUIRING = "acquiring"  # the Acquire is out; descriptors assembled meanwhile
    READING = "reading"  # the read phase: posting, replies judged, transfers running
    QUARANTINED = "quarantined"  # failed, but a transfer may still land: not reported yet
    DONE = "done"
    FAILED = "failed"


class On(enum.Enum):
    """What happened to a pull."""

    EARLY_ACQUIRE = "early_acquire"  # handshake cached: the Acquire leaves with the Pull
    WAIT_RANKS = "wait_ranks"
    HANDSHAKE = "handshake"
    ACQUIRE = "acquire"
    ASSEMBLED = "assembled"  # the transfers are known: the read phase begins
    POST = "post"  # transfers posted (again, after a read-again)
    STALE = "stale"  # the Acquire's replies name another incarnation or epoch: greet again
    QUARANTINE = "quarantine"  # failing with transfers still running
    FINISH = "finish"  # every transfer done, every Acquire reply good; released
    FAIL = "fail"  # failed (or cancelled) with nothing running any more; released


S = PullState
LIVE = (S.QUEUED, S.WAITING_RANKS, S.HANDSHAKING, S.ACQUIRING, S.READING)
TERMINAL = (S.DONE, S.FAILED)

TRANSITIONS: dict[PullState, dict[On, PullState]] = {
    S.QUEUED: {On.EARLY_ACQUIRE: S.ACQUIRING, On.WAIT_RANKS: S.WAITING_RANKS},
    S.WAITING_RANKS: {On.HANDSHAKE: S.HANDSHAKING},
    S.HANDSHAKING: {On.ACQUIRE: S.ACQUIRING},
    S.ACQUIRING: {On.ASSEMBLED: S.READING},
    S.READING: {On.POST: S.READING, On.STALE: S.WAITING_RANKS, On.FINISH: S.DONE},
    S.QUARANTINED: {On.FAIL: S.FAILED},
    S.DONE: {},
    S.FAILED: {},
}
# Failing is possible from every live state: at once when nothing can land any more,
# else through QUARANTINED.
for _state in LIVE:
    TRANSITIONS[_state][On.FAIL] = S.FAILED
TRANSITIONS[S.READING][On.QUARANTINE] = S.QUARANTINED  # transfers exist only once posted

FINISHED_KEEP = 64  # finished pulls listed by `kvd status`
FINISHED_KEEP_S = 30.0


def next_state(state: PullState, event: On) -> PullState:
    """Raises kvd.daemon.transitions.BadTransition for a move the table does not list."""
    return step(TRANSITIONS, state, event, "a pull")


def diagram() -> str:
    """The table as lines ``state --event--> state``, in the table's order."""
    return "\n".join(f"{s.value} --{e.value}--> {t.value}"
                     for s, moves in TRANSITIONS.items() for e, t in moves.items())
