"""The one way kvd writes a lifecycle: a table of transitions, looked up here.

A pull (kvd.daemon.pull.state), a held request (kvd.daemon.produce.held) and an engine
rank (kvd.daemon.engines.table) each keep every move of their lifecycle in one
``{state: {event: next state}}`` table; their objects change state only through it. A
move the table does not list raises `BadTransition`: a bug in kvd, never an input.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class BadTransition(RuntimeError):
    """A move the table does not allow: a bug in kvd, never an input."""


def step(table: Mapping[S, Mapping[E, S]], state: S, event: E, what: str) -> S:
    """The state after ``event``, by ``table``; ``what`` names the object in the error
    ("a pull")."""
    try:
        return table[state][event]
    except KeyError:
        raise BadTransition(f"{what} in state {state.value} cannot {event.value}") from None
