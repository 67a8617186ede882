"""vLLM's NixlConnector with NIXL's progress thread off, for ``kvd bench vllm``.

vLLM builds its NIXL agent with the default ``enable_prog_thread=True``: a thread per
agent that busy-spins (0.6-1.0 core per idle engine on a 2-core host, which slows the
engine's own steps). vLLM offers no setting for it, so this module, loaded by vLLM as
``kv_connector_module_path`` in every engine process, wraps the agent config vLLM's
NIXL worker uses to pass ``enable_prog_thread=False``; the connector is otherwise
vLLM's own class, unchanged. Progress is then made when vLLM's worker checks its
transfers (once per step), as NIXL documents for that mode.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from kvd.integrations.vllm import executor_wait
from kvd.integrations.vllm.connector import CPU_QUEUE_SPIN_S

_vllm_agent_config = base_worker.nixl_agent_config


def _quiet_agent_config(*args: Any, **kwargs: Any) -> Any:
    kwargs["enable_prog_thread"] = False
    return _vllm_agent_config(*args, **kwargs)


if _vllm_agent_config is not None:
    base_worker.nixl_agent_config = _quiet_agent_config


class QuietNixlConnector(NixlConnector):
    """vLLM's NixlConnector; its NIXL agent runs without a progress thread."""


class CappedNixlConnector(QuietNixlConnector):
    """The same, with vLLM's queue readers spinning at most CPU_QUEUE_SPIN_S per wait, as
    kvd's connector has them on CPU engines (kvd.integrations.vllm.executor_wait): the
    NixlConnector a user would get with that one engine-side change, so that the bench
    can tell what the transfer layer gives from what the cap gives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if executor_wait.install():
            executor_wait.cap_spin(CPU_QUEUE_SPIN_S)
