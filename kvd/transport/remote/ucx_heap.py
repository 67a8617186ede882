"""Zeroed heap memory for UCX's request pool: what keeps a producer alive when a
consumer severs its READs (docs/reliability.md, "The producer survives a severed
consumer").

Why: over UCX's TCP transport a READ is emulated with GET request/reply active
messages. UCX 1.23 (bundled with nixl-cu12 1.5.1, and still so in UCX master)
allocates each GET reply from the worker's request pool in ``ucp_get_req_handler``
(rma_sw.c) without setting ``req->send.datatype``. When the endpoint fails while
replies wait in its pending queue (the consumer severed the connection, a partition,
a frozen producer waking up), ``uct_tcp_ep_pending_purge`` hands each to
``ucp_request_send_state_ff``, which deregisters the request's memory handles by that
datatype: a stale value of the IOV class makes it free a garbage ``memhs`` pointer
(SIGSEGV in ``ucp_request_memory_dereg``). The value is whatever the pool's memory
held: the pool grows with ``malloc``, which returns recycled heap bytes. With zeroed
memory the datatype reads as contiguous, whose handle ``ucp_request_send_state_init``
has just set to NULL, and the purge only completes the request.

glibc's ``M_PERTURB`` makes every ``malloc`` return memory filled with the complement of
the given byte (0xFF: zeros) and fills freed memory with that byte. It is process-wide
and costs a ``memset`` per allocation and per free (not ``calloc``, not Python's small
objects, not kvd's pools, which are shared memory); measured in
docs/notes/2026-11-26-ucx-purge-crash.md.
Measured on this bug: `tests/support/multinode/ucx_purge_repro.py`.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("kvd.transport")

M_PERTURB = -6  # glibc's mallopt parameter (malloc.h)
PERTURB_BYTE = 0xFF  # malloc fills with ~0xFF: zeros
OPT_OUT_ENV = "KVD_UCX_ZERO_HEAP"  # "0": leave the heap as glibc has it

_applied: bool | None = None


def zero_fresh_heap() -> bool:
    """Make ``malloc`` return zeroed memory from now on in this process (once; before
    the first NIXL agent, so that UCX's request pool grows on it); whether it is.

    False, with one warning, where the C library has no ``M_PERTURB`` (not glibc) or
    ``KVD_UCX_ZERO_HEAP=0`` turns it off: the producer may then crash as described
    above when a consumer's READs fail."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(OPT_OUT_ENV, "1") == "0":
        log.warning("%s=0: UCX 1.23 may crash this daemon when a consumer's READs are "
                    "severed (docs/reliability.md)", OPT_OUT_ENV)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None:
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _applied = mallopt(M_PERTURB, PERTURB_BYTE) == 1
    if not _applied:
        log.warning("this C library has no mallopt(M_PERTURB): UCX 1.23 may crash this "
                    "daemon when a consumer's READs are severed (docs/reliability.md)")
    return _applied
