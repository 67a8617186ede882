"""Which pulls an engine still waits for, as its scheduler sees them: does an empty step
wait only for progressive pulls?

A decode whose requests wait only for progressive pulls waits for a whole prefill
(seconds), not for a copy (milliseconds); vLLM steps it on all the while. Such steps may
park longer (``kvd_progressive_idle_wait_s``): the KV's arrival still ends the park at
once (the worker's parked Poll is answered by the event), so only a new request reaching
the engine meanwhile waits, up to the park.

The scheduler's view is a superset of what is truly outstanding: a pull is noted when
its message goes and forgotten when vLLM reports its receive finished (ok or failed,
``update_connector_output``) or the request finishes, a step or more after the worker
saw its event. So "every pull out is progressive" here means no ordinary pull is out.
Sans-IO: no socket, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_PULLS_KEPT = 100_000  # a request vLLM never reports again must not pin memory


class PullsOut:
    """Pulls sent and not yet reported finished: request id -> progressive."""

    def __init__(self) -> None:
        self._out: dict[str, bool] = {}

    def sent(self, request_id: str, progressive: bool) -> None:
        self._out[request_id] = progressive
        while len(self._out) > MAX_PULLS_KEPT:
            del self._out[next(iter(self._out))]

    def ended(self, request_ids: Iterable[str]) -> None:
        """vLLM reported these receives finished, or the requests finished."""
        for rid in request_ids:
            self._out.pop(rid, None)

    @property
    def only_progressive(self) -> bool:
        """At least one pull is out and every one is progressive."""
        return bool(self._out) and all(self._out.values())

    def __len__(self) -> int:
        return len(self._out)
