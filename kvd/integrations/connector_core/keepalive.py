"""Keep the engine's ranks alive at the daemon from the engine-core process.

The daemon treats a rank silent for engine_timeout_s as gone. Pinging from
the worker processes is not enough: a vLLM CPU worker can hold the GIL for
tens of seconds while it waits for work, starving the client's ping thread,
and the daemon then drops a healthy engine (seen in the whole-engine tests).
The engine-core process stays responsive, so it pings every rank of the
engine; a rank not registered yet (or gone) is simply skipped.
"""

from __future__ import annotations

import threading

from kvd.client import KvdClient
from kvd.errors import KvdError
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.wire.protocol import Ping

PING_INTERVAL_S = 5.0


class RankKeepalive:
    def __init__(self, settings: ConnectorSettings, tp_size: int, pp_size: int) -> None:
        self._settings = settings
        self._ranks = [(t, p) for p in range(pp_size) for t in range(tp_size)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvd-keepalive")
        self._thread.start()

    def _run(self) -> None:
        with KvdClient(self._settings.address, token=self._settings.token,
                       timeout_s=self._settings.request_timeout_s, ping_interval_s=0) as c:
            while not self._stop.wait(PING_INTERVAL_S):
                for tp_rank, pp_rank in self._ranks:
                    try:
                        c.call(Ping(engine_id=self._settings.engine_id, tp_rank=tp_rank,
                                    pp_rank=pp_rank))
                    except KvdError:
                        pass  # not registered yet, or gone: the worker's own client reports it

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PING_INTERVAL_S + 1)
