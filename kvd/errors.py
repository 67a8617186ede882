"""Error types shared by every layer.

Each error carries a stable machine-readable ``code`` so that the daemon can
send it in an error reply and a client can re-raise the same class on its side.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base class: anything kvd refuses or fails with a reason a user can act on."""

    code = "error"


class PlanError(KvdError, ValueError):
    """A parallel configuration an engine cannot run, or two engines that cannot pair."""

    code = "bad_plan"


class LayoutError(KvdError, ValueError):
    """A cache layout that cannot be described with plain byte-range descriptors."""

    code = "bad_layout"


class ConfigError(KvdError, ValueError):
    """A configuration value that fails validation at start."""

    code = "bad_config"


class ProtocolError(KvdError):
    """A message that cannot be decoded or is not allowed in this state."""

    code = "protocol"


class NotFoundError(KvdError):
    """A request, engine or peer that the daemon does not know (or no longer holds)."""

    code = "not_found"


class IncompatibleError(KvdError):
    """Two engines whose model, dtype or layout differ, or a protocol version mismatch."""

    code = "incompatible"


class BusyError(KvdError):
    """A bounded queue or table is full; retry later."""

    code = "busy"


class DrainingError(KvdError):
    """The daemon is draining for shutdown and takes no new work."""

    code = "draining"


class TransferError(KvdError):
    """A NIXL transfer ended in error (peer gone, backend failure)."""

    code = "transfer_failed"


class AuthError(KvdError):
    """A message without the shared token the daemon requires."""

    code = "unauthorized"


class KvdTimeoutError(KvdError, TimeoutError):
    """A bounded wait ran out (handshake, reply, transfer)."""

    code = "timeout"


ERRORS_BY_CODE: dict[str, type[KvdError]] = {
    cls.code: cls
    for cls in (
        KvdError,
        PlanError,
        LayoutError,
        ConfigError,
        ProtocolError,
        NotFoundError,
        IncompatibleError,
        BusyError,
        DrainingError,
        TransferError,
        AuthError,
        KvdTimeoutError,
    )
}


def error_from_code(code: str, message: str) -> KvdError:
    """Rebuild the error a daemon reported, so clients can catch specific classes."""
    return ERRORS_BY_CODE.get(code, KvdError)(message)
