"""The connector's settings, read once from vLLM's kv_transfer_config.

Everything a user can set lives in ``kv_connector_extra_config`` under a
``kvd_`` prefix, so it never collides with vLLM's own keys or another
connector's in a MultiConnector.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd.config import client_engine_address
from kvd.errors import ConfigError

# kvd_progressive_idle_wait_s is capped here: it is what a new request may wait for
# its first step on an engine waiting only for progressive pulls
MAX_PROGRESSIVE_IDLE_WAIT_S = 0.5
# vLLM's shared-memory queue readers spin this long after their last read: a cap at or
# over it leaves vLLM's own behaviour
VLLM_QUEUE_SPIN_S = 1.0
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class ConnectorConfigError(ValueError):
    """A kv_transfer_config kvd cannot run with; the message says what to set."""


@dataclass(frozen=True)
class ConnectorSettings:
    engine_id: str
    address: str  # the local kvd's engine face
    token: str
    lease_s: float | None  # None: the daemon's default lease
    consumers: int  # decode engines that read each published request (fan-out)
    pull_timeout_s: float  # the worker gives up on a pull the daemon never answers
    kv_layout: str | None  # forced layout name, else the connector's default
    model_name: str | None
    request_timeout_s: float
    # the longest an empty step (every request waiting for its KV) waits for kvd's
    # events, woken by them; 0: never wait (spin through empty steps, as vLLM does)
    idle_wait_s: float = 0.005
    # the same while every pull out is progressive (the engine waits for a whole prefill):
    # the longest a new request reaching that engine may wait for its first step
    progressive_idle_wait_s: float = 0.05
    # the producer engines this engine pulls from, (engine id, their daemon's peer
    # address) each: its daemon greets them at start-up, ahead of the first pull
    producers: tuple[tuple[str, str], ...] = ()
    # how long this engine's vLLM queue readers (engine core, workers) spin in
    # sched_yield waiting for a message before they sleep until it comes
    # (kvd.integrations.vllm.executor_wait); None: the platform's default (CPU engines
    # 0.005 s, others vLLM's own); VLLM_QUEUE_SPIN_S or more: vLLM's own
    queue_spin_s: float | None = None

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> ConnectorSettings:
        extra: dict[str, Any] = dict(kv_transfer_config.kv_connector_extra_config or {})
        engine_id = kv_transfer_config.engine_id or ""
        if not engine_id or _UUID.match(engine_id):
            raise ConnectorConfigError(
                "KvdConnector needs an explicit, stable engine_id in --kv-transfer-config "
                "(e.g. \"engine_id\":\"prefill-0\"); vLLM's default is a random uuid, which "
                "breaks pulls across engine restarts")
        token = extra.get("kvd_token")
        if token is None:
            path = extra.get("kvd_token_file") or os.environ.get("KVD_AUTH_TOKEN_FILE", "")
            try:
                token = Path(path).read_text().strip() if path else ""
            except OSError as exc:
                raise ConnectorConfigError(f"kvd_token_file / KVD_AUTH_TOKEN_FILE {path!r}: "
                                           f"{exc.strerror}") from None
        try:
            address = client_engine_address(extra.get("kvd_address") or None, name="kvd_address")
        except ConfigError as exc:  # one line naming the key, not ZMQ's "Invalid argument"
            raise ConnectorConfigError(str(exc)) from None
        try:
            lease = extra.get("kvd_lease_s")
            return cls(
                engine_id=engine_id,
                address=address,
                token=str(token),
                lease_s=None if lease is None else float(lease),
                consumers=int(extra.get("kvd_consumers", 1)),
                pull_timeout_s=float(extra.get("kvd_pull_timeout_s", 120.0)),
                kv_layout=extra.get("kvd_kv_layout"),
                model_name=extra.get("kvd_model_name"),
                request_timeout_s=float(extra.get("kvd_request_timeout_s", 10.0)),
                idle_wait_s=max(0.0, min(0.05, float(extra.get("kvd_idle_wait_s", 0.005)))),
                progressive_idle_wait_s=max(0.0, min(MAX_PROGRESSIVE_IDLE_WAIT_S, float(
                    extra.get("kvd_progressive_idle_wait_s", 0.05)))),
                producers=_producers(extra.get("kvd_producers")),
                queue_spin_s=_queue_spin_s(extra.get("kvd_queue_spin_s")),
            )
        except (TypeError, ValueError) as exc:
            raise ConnectorConfigError(f"bad kvd_* value in kv_connector_extra_config: "
                                       f"{exc}") from None


def _queue_spin_s(value: Any) -> float | None:
    if value is None:
        return None
    spin_s = float(value)
    if not spin_s >= 0:  # also NaN
        raise ValueError(f"kvd_queue_spin_s must be >= 0 seconds, got {value!r}")
    return min(spin_s, VLLM_QUEUE_SPIN_S)


def _producers(value: Any) -> tuple[tuple[str, str], ...]:
    """``kvd_producers``: [{"engine_id": ..., "address": ...}, ...] (address: the peer
    address of a daemon hosting that producer engine, ``kvd serve --peer-address``)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConnectorConfigError("kvd_producers must be a list of {\"engine_id\": ..., "
                                   "\"address\": ...} (the producer engine and the peer "
                                   "address of its kvd)")
    out = []
    for item in value:
        if (not isinstance(item, dict) or set(item) != {"engine_id", "address"}
                or not all(isinstance(v, str) and v for v in item.values())):
            raise ConnectorConfigError(
                f"kvd_producers: {item!r} is not {{\"engine_id\": \"prefill-0\", "
                "\"address\": \"tcp://host:port\"}} (the producer engine and the peer "
                "address of its kvd)")
        out.append((item["engine_id"], item["address"]))
    return tuple(out)
