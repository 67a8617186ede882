"""Engine integrations: glue that lets an unmodified inference engine use kvd.

``kvd.integrations.vllm`` is the vLLM boundary: only what imports vLLM, and
``compat`` with every difference between the tested vLLM versions.
``kvd.integrations.connector_core`` is the connector's logic (scheduler half, worker
half, completions, settings, geometry checks), importable and unit-tested without
vLLM installed.
"""
