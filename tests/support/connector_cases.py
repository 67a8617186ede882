"""Small vLLM KV geometries for the connector's tests (no vLLM needed)."""

from __future__ import annotations

from kvd.integrations.connector_core.geometry import VllmKvGeometry


def tiny_geometry() -> VllmKvGeometry:
    """Two layers of two KV heads, four 32-token blocks, one rank, CPU layout."""
    return VllmKvGeometry(model_name="m", total_kv_heads=2, total_layers=2, heads_on_rank=2,
                          layer_names=("l0", "l1"), head_size=64, head_size_v=64,
                          dtype="float16", mla=False, block_size_tokens=32, num_blocks=4,
                          kv_layout="LBHNC", buf_nbytes=4 * 2 * 2 * 32 * 2 * 64 * 2,
                          tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
