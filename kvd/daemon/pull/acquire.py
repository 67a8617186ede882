"""A pull's Acquire: the pure rules that judge its replies.

The Acquire leaves before the descriptors are assembled, and small READs are posted
without waiting for its replies (one control round trip on the request path,
overlapped with the READ). Nothing read is trusted, and no READ notice sent, before
every reply is in and judged (`judge`): a refused Acquire fails the pull (its blocks
reported invalid), replies from another incarnation or engine epoch than the cached
handshake make it greet again, and a hold younger than the time from posting to the
reply (the READ may predate the publish) makes it read again.

`Replies` and the functions below are pure (no I/O: the pull's machine imports them);
`kvd.daemon.pull.acquiring.Acquiring` holds the futures of the requests on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvd.daemon.peers.remote import RemoteDaemon
from kvd.daemon.peers.reply import Reply
from kvd.wire import protocol as P


@dataclass(frozen=True)
class Replies:
    """Every producer daemon's reply to one Acquire, by daemon address."""

    by_address: Mapping[str, Reply]

    def current(self, daemons: Mapping[str, RemoteDaemon]) -> bool:
        """Whether each came from the daemon incarnation and engine epoch of the cached
        handshake: False, the addresses we know may be stale."""
        return all(r.instance == daemons[a].instance and r.body.epoch == daemons[a].epoch
                   for a, r in self.by_address.items())


def receipted(msg: P.Pull, daemons: Mapping[str, RemoteDaemon], agent: str) -> bool:
    """Whether the pull's publish receipt names the cached incarnation of every daemon
    behind ``agent``: then the publish happened before the Pull was sent, and a READ from
    it may go out before the Acquire's reply whatever its size."""
    receipt = msg.publish_receipt
    behind = [d for d in daemons.values() if d.agent == agent]
    return bool(receipt and behind) and all(receipt.startswith(d.instance + "/")
                                            for d in behind)


def may_predate_publish(msg: P.Pull, daemons: Mapping[str, RemoteDaemon], replies: Replies,
                        agent: str, posted_s: float) -> bool:
    """Whether a READ from ``agent`` posted at ``posted_s`` (before its daemon's reply came)
    may have run before the request was published there. Not if the reply names the hold
    of the pull's publish receipt: that hold existed before the Pull was sent, and lasted
    until the Acquire joined it. Otherwise the producer held it for ``held_s`` when the
    Acquire arrived, at most ``received_s - posted_s`` after the post; a hold older than
    that began before the READ."""
    receipt = msg.publish_receipt
    for a, d in daemons.items():
        r = replies.by_address[a]
        if d.agent != agent or (receipt and P.receipt(r.instance, r.body.hold_id) == receipt):
            continue
        if r.body.held_s < r.received_s - posted_s:
            return True
    return False
