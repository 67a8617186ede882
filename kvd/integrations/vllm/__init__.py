"""kvd as a vLLM KV connector: ``--kv-transfer-config '{"kv_connector":"KvdConnector",
"kv_connector_module_path":"kvd.integrations.vllm", ...}'`` (see docs/vllm.md).

Importing this module checks the installed vLLM first: the connector API is
tested against 0.32.x and 0.33.x only, and an untested engine should fail in
one line at startup rather than misbehave on the first transfer.
"""

from __future__ import annotations

TESTED_VLLM = ((0, 32), (0, 33))


def _check_vllm_version() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"kvd.integrations.vllm needs vLLM 0.32.x or 0.33.x installed "
                          f"({exc})") from None
    version = getattr(vllm, "__version__", "unknown")
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        major_minor = (-1, -1)
    if major_minor not in TESTED_VLLM:
        raise ImportError(f"kvd.integrations.vllm supports vLLM 0.32.x and 0.33.x; "
                          f"found vLLM {version}")
    return version


VLLM_VERSION = _check_vllm_version()

from kvd.integrations.vllm.connector import KvdConnector  # noqa: E402

__all__ = ["KvdConnector", "TESTED_VLLM", "VLLM_VERSION"]
