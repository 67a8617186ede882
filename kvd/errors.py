"""Error types shared by every layer: one tree, one stable code per class.

Each error carries a machine-readable ``code`` (a class attribute, never changed
after raising) so that the daemon can send it in an ``Error`` reply and a client
re-raises the same class on its side (``error_from_code``). Catch a branch to
handle a family, as with httpx::

    KvdError                        "error"            refused, with a reason to act on
    ├── InvalidRequestError         "invalid"          the request itself is wrong: do not retry
    │   ├── ProtocolError           "protocol"         malformed frames, header or body
    │   │   └── VersionError        "incompatible"     another protocol version
    │   ├── BlockIdError            "bad_block_ids"    block ids negative, out of range, unpublished
    │   ├── TooLargeError           "too_large"        over a configured size cap
    │   ├── PlanError               "bad_plan"         a parallel configuration that cannot run/pair
    │   ├── LayoutError             "bad_layout"       a cache layout descriptors cannot describe
    │   └── ConfigError             "bad_config"       a configuration value (at start)
    ├── NotFoundError               "not_found"        unknown engine, request never held or gone
    ├── IncompatibleError           "incompatible"     engines whose model, dtype or layout differ
    ├── UnavailableError            "unavailable"      not now: retry later or elsewhere
    │   ├── BusyError               "busy"             a bounded table or queue is full
    │   ├── DrainingError           "draining"         the daemon is shutting down
    │   └── IncompleteEngineError   "incomplete"       not every rank of the engine is registered
    ├── TransferError               "transfer_failed"  a NIXL READ or notification failed
    │   └── PeerLostError           "peer_lost"        the producer daemon died or restarted
    ├── KvdTimeoutError             "timeout"          a bounded wait ran out
    ├── AuthError                   "unauthorized"     missing or wrong shared token
    └── InternalError               "internal"         a daemon bug; the daemon keeps serving

``VersionError`` is a ``ProtocolError`` (counted as one) that reports the code
``incompatible``; ``error_from_code("incompatible")`` rebuilds ``IncompatibleError``.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base class: anything kvd refuses or fails with a reason a user can act on."""

    code = "error"


class InvalidRequestError(KvdError, ValueError):
    """The request is wrong as sent; the same request will fail again."""

    code = "invalid"


class ProtocolError(InvalidRequestError):
    """A message that cannot be decoded or is not allowed on this face.

    ``reason`` says why, for ``kvd_protocol_errors_total``: decode (malformed), unknown
    (a kind this face does not accept), version, limit (over a size or depth bound).
    """

    code = "protocol"

    def __init__(self, message: str, reason: str = "decode") -> None:
        super().__init__(message)
        self.reason = reason


class VersionError(ProtocolError):
    """The peer speaks another protocol version (answered ``incompatible``)."""

    code = "incompatible"

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="version")


class BlockIdError(InvalidRequestError):
    """Block ids that are negative, out of a pool's range, or were not published."""

    code = "bad_block_ids"


class TooLargeError(InvalidRequestError):
    """A pool, message or request over a configured cap (the message names the cap)."""

    code = "too_large"


class PlanError(InvalidRequestError):
    """A parallel configuration an engine cannot run, or two engines that cannot pair."""

    code = "bad_plan"


class LayoutError(InvalidRequestError):
    """A cache layout that cannot be described with plain byte-range descriptors."""

    code = "bad_layout"


class ConfigError(InvalidRequestError):
    """A configuration value that fails validation at start."""

    code = "bad_config"


class NotFoundError(KvdError):
    """A request, engine or peer that the daemon does not know (or no longer holds)."""

    code = "not_found"


class IncompatibleError(KvdError):
    """Two engines whose model, dtype or layout differ, or a protocol version mismatch."""

    code = "incompatible"


class UnavailableError(KvdError):
    """Refused for now; the same request may succeed later or on another daemon."""

    code = "unavailable"


class BusyError(UnavailableError):
    """A bounded queue or table is full; retry later."""

    code = "busy"


class DrainingError(UnavailableError):
    """The daemon is draining for shutdown and takes no new work."""

    code = "draining"


class IncompleteEngineError(UnavailableError):
    """An engine's ranks are not all registered (within the wait the daemon allows)."""

    code = "incomplete"


class TransferError(KvdError):
    """A NIXL transfer or notification ended in error."""

    code = "transfer_failed"


class PeerLostError(TransferError):
    """The producer daemon of a pull died or restarted while the pull depended on it."""

    code = "peer_lost"


class KvdTimeoutError(KvdError, TimeoutError):
    """A bounded wait ran out (handshake, reply, transfer)."""

    code = "timeout"


class AuthError(KvdError):
    """A message without the shared token the daemon requires."""

    code = "unauthorized"


class InternalError(KvdError):
    """A bug in a daemon handler; reported, logged, and the daemon keeps serving."""

    code = "internal"


ERRORS_BY_CODE: dict[str, type[KvdError]] = {
    cls.code: cls
    for cls in (
        KvdError,
        InvalidRequestError,
        ProtocolError,
        BlockIdError,
        TooLargeError,
        PlanError,
        LayoutError,
        ConfigError,
        NotFoundError,
        IncompatibleError,
        UnavailableError,
        BusyError,
        DrainingError,
        IncompleteEngineError,
        TransferError,
        PeerLostError,
        KvdTimeoutError,
        AuthError,
        InternalError,
    )
}


def error_from_code(code: str, message: str) -> KvdError:
    """Rebuild the error a daemon reported, so clients can catch specific classes."""
    return ERRORS_BY_CODE.get(code, KvdError)(message)
