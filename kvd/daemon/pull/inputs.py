"""What happens to a pull: the inputs its driver feeds to `Pull.handle`
(kvd.daemon.pull.machine), the one entry point of the machine. Each is a small
value carrying facts (what the handshake was, what a poll said, whether the engine
registered again); the machine decides what they mean and returns the actions
(kvd.daemon.pull.actions) that follow. Made on every step of every pull, they are plain
slotted classes (a frozen dataclass costs about three times as much to make), treated as
values all the same: nothing changes one once it is made."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.actions import Notice
from kvd.daemon.pull.state import Path
from kvd.transport.base import PostResult, ReadPost, XferStatus


@dataclass(slots=True)
class Begin:
    """The pull starts. ``cached``: the handshake cached for the engine pair (when every
    rank of the consumer engine is registered), with ``path``, the mover chosen for it
    (None: none could be, its host mappings were retired)."""

    cached: RemoteEngine | None
    path: Path | None = None


@dataclass(slots=True)
class RanksReady:
    """Every rank of the consumer engine is registered; ``again``: by another
    registration than the one the pull started with."""

    again: bool = False


@dataclass(slots=True)
class Greeted:
    """The handshake, and ``path``, the mover chosen for it; None: none could be (its
    producer freed a pool meanwhile, its mappings were retired)."""

    remote: RemoteEngine
    path: Path | None


@dataclass(slots=True)
class AcquireSent:
    """The Acquire left (its reply is due within the liveness timeout)."""


@dataclass(slots=True)
class Assembled:
    posts: Sequence[ReadPost]
    notices: Sequence[Notice]
    nbytes: int
    descriptors: int
    answered: bool  # the Acquire's replies are all in already


@dataclass(slots=True)
class AssemblyFailed:
    error: str


@dataclass(slots=True)
class Posted:
    results: Sequence[PostResult]
    posted_s: float
    post_s: float


@dataclass(slots=True)
class RepliesIn:
    """Every reply to the Acquire (or the error in its place), in address order."""

    addresses: Sequence[str]
    got: Sequence[Reply | BaseException]


@dataclass(slots=True)
class Polled:
    """States of the transfers polled; ``unreachable``: producer daemon addresses whose
    control connection liveness lost."""

    states: Mapping[int, XferStatus]
    unreachable: frozenset[str] = frozenset()


@dataclass(slots=True)
class Probed:
    """One producer daemon's answer to the probe after a failed transfer (None:
    unreachable, by liveness or by the probe itself)."""

    address: str
    reply: Reply | None


@dataclass(slots=True)
class Confirmed:
    """"" when the producer's incarnation outlived every copy, else why not."""

    gone: str


@dataclass(slots=True)
class Discarded:
    """The discarded transfers ended and were released, the pools unpinned."""


@dataclass(slots=True)
class Released:
    """Every handle released and the pools unpinned."""


@dataclass(slots=True)
class LeaseReply:
    address: str
    reply: Reply


@dataclass(slots=True)
class Interrupted:
    """The pull's task was cancelled: by its own deadline (``deadline``), else by the
    daemon stopping (the pull's ``cancel_reason``, or a drain)."""

    deadline: bool


@dataclass(slots=True)
class Raised:
    """Carrying an action out raised this (the pull fails with it)."""

    error: BaseException


Input = (Begin | RanksReady | Greeted | AcquireSent | Assembled | AssemblyFailed | Posted
         | RepliesIn | Polled | Probed | Confirmed | Discarded | Released | LeaseReply
         | Interrupted | Raised)
