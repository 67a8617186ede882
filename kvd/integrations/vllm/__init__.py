"""kvd as a vLLM KV connector: ``--kv-transfer-config '{"kv_connector":"KvdConnector",
"kv_connector_module_path":"kvd.integrations.vllm", ...}'`` (see docs/vllm.md).

This package holds only what imports vLLM: the connector class, vLLM's metadata and
stats classes, the reader of vLLM's KV cache facts, and ``compat`` (the tested vLLM
versions and every difference between them). The logic lives, vLLM-free, in
``kvd.integrations.connector_core``.

Importing this package checks the installed vLLM first (``compat.check_vllm_version``):
an untested engine fails in one line at start-up. Then, when vLLM imports it to build a
server's config (``kvd.integrations.connector_core.preflight``), it dials the daemon the
config names: a kvd that does not answer ends the server there, with kvd's line last.
"""

from __future__ import annotations

import sys

from kvd.integrations.connector_core.preflight import check_at_import
from kvd.integrations.vllm.compat import TESTED_VLLM, check_vllm_version

VLLM_VERSION = check_vllm_version()
check_at_import(sys._getframe())

from kvd.integrations.vllm.connector import KvdConnector  # noqa: E402

__all__ = ["KvdConnector", "TESTED_VLLM", "VLLM_VERSION"]
