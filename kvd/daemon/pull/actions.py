"""What a pull's machine returns: the actions its driver carries out (kvd.daemon.pull.
machine decides them, kvd.daemon.pull.driver carries them out; both import them from
here; what the driver feeds back is in kvd.daemon.pull.inputs). Each is a small frozen
value; none does anything by itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvd.errors import TransferError
from kvd.transport.base import ReadPost
from kvd.wire import protocol as P

Notice = tuple[str, P.ReadNotice]  # (producer agent, its notice)


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class WaitRanks:
    """Wait (bounded) until every rank of the consumer engine is registered."""


@dataclass(frozen=True)
class Greet:
    """Handshake with the producer's daemons (cached per engine pair)."""


@dataclass(frozen=True)
class ForgetHandshake:
    """The cached handshake proved stale (a producer daemon restarted, or its pools
    changed): drop it, so that the next greeting is a fresh one."""


@dataclass(frozen=True)
class SendAcquire:
    """Ask every producer daemon to hold the request for us (replies come later)."""


@dataclass(frozen=True)
class Assemble:
    """Plan the descriptors and build the transfers (then `Assembled` or `AssemblyFailed`)."""


@dataclass(frozen=True)
class Post:
    """Pin the local pools and post these transfers (after checking the quarantine caps
    unless ``again``: a read-again is the same pull's transfers)."""

    posts: tuple[ReadPost, ...]
    again: bool = False


@dataclass(frozen=True)
class AwaitReplies:
    """Every reply to the Acquire is needed before going on (`RepliesIn`)."""


@dataclass(frozen=True)
class PollAfter:
    """Poll the transfers that have not ended, after ``delay_s`` (0: a loop turn)."""

    delay_s: float


@dataclass(frozen=True)
class KeepLeases:
    """From now until the pull reported, renew the producers' leases on its READs
    (heartbeats every ``heartbeat_interval_s`` to `Pull.lease_addresses`): a big READ can
    outlast a lease."""


@dataclass(frozen=True)
class Probe:
    """A transfer failed: is the producer daemon at ``address`` still the incarnation we
    greeted (`Probed`)? The first probe of a failure drops the cached
    producer daemons (``drop``) before asking."""

    address: str
    error: TransferError
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Confirm:
    """Every copy of a host-path pull ended: is the daemon incarnation owning the pool
    files it read still alive (`Confirmed`)? A successor could have adopted them and
    its engine reused the blocks under the copy, which never fails by itself."""


@dataclass(frozen=True)
class Discard:
    """Every transfer posted ended (failed or not; their bytes are not trusted): release
    them and unpin, then `Discarded`."""


@dataclass(frozen=True)
class Sever:
    """Tear down the data connections to these producers (agent -> control addresses):
    their transfers fail at the next poll."""

    producers: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class Quarantine:
    """Count the pull as quarantined (``enter``) or not any more."""

    enter: bool
    nbytes: int


@dataclass(frozen=True)
class Warn:
    text: str


@dataclass(frozen=True)
class Release:
    """Release every transfer handle (none can land any more), unpin, then
    `Released`."""


@dataclass(frozen=True)
class Report:
    """Deliver the outcome to the engine, then count it; ``notices`` (ok) or ``abandon``
    (failed: producer daemons that hold the request for us) after that."""

    event: P.Event
    notices: tuple[Notice, ...]
    abandon: tuple[str, ...]


Action = (WaitRanks | Greet | ForgetHandshake | SendAcquire | Assemble | Post | AwaitReplies
          | PollAfter | KeepLeases | Probe | Confirm | Discard | Sever | Quarantine | Warn
          | Release | Report)

