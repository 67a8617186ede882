"""The daemon-wide bounds on quarantined pulls.

The rule (docs/reliability.md "No write after hand-back"): a pull is reported, and its
local blocks handed back, only once none of its transfers can land any more, that is
once the transport has completed or failed every one. Releasing a running NIXL request
does not stop UCX (``ucp_request_cancel`` is a no-op for RMA; NIXL 1.5 closes endpoints
in flush mode), and across a partition a READ resumes when the link comes back. So a
failing pull whose transfers still run is QUARANTINED (kvd.daemon.pull.state: not
reported, blocks kept, counted in ``kvd_quarantined_pulls``/``kvd_quarantined_bytes``,
listed by ``kvd status``), and its producers' data connections are severed
(kvd.daemon.pull.machine decides when; the mover does it).

Where nothing can be severed (an RDMA fabric under NIXL 1.5: no socket to shut, no forced
endpoint close) the pull stays quarantined until the transport ends the READ, possibly
for as long as the daemon runs. That is bounded here: past ``max_quarantined_pulls`` or
``max_quarantined_bytes`` a new pull fails ``busy`` before posting anything, rather than
let stuck READs pin memory without end.
"""

from __future__ import annotations

from kvd.config import Config
from kvd.errors import BusyError
from kvd.ops.metrics import Metrics


class QuarantineCounts:
    def __init__(self, cfg: Config, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.pulls = 0
        self.nbytes = 0

    def check_room(self, nbytes: int) -> None:
        """Raise BusyError when one more quarantined pull of ``nbytes`` would pass a cap.

        Called before posting: a pull refused here has nothing in flight to lose."""
        cfg = self.cfg
        if self.pulls >= cfg.max_quarantined_pulls or (
                self.pulls and self.nbytes + nbytes > cfg.max_quarantined_bytes):
            raise BusyError(
                f"{self.pulls} pulls ({self.nbytes} bytes) are quarantined: READs the "
                "transport has not ended may still land in their blocks (max_quarantined_"
                f"pulls={cfg.max_quarantined_pulls}, max_quarantined_bytes="
                f"{cfg.max_quarantined_bytes}); no new pull until they end")

    def enter(self, nbytes: int) -> None:
        self.pulls += 1
        self.nbytes += nbytes
        self.metrics.quarantined_pulls.inc()
        self.metrics.quarantined_bytes.inc(nbytes)

    def leave(self, nbytes: int) -> None:
        self.pulls -= 1
        self.nbytes -= nbytes
        self.metrics.quarantined_pulls.dec()
        self.metrics.quarantined_bytes.dec(nbytes)
