"""The vLLM connector's logic that needs no vLLM: parameters, geometry, event mapping.

Kept apart from ``kvd.integrations.vllm`` so the default test suite proves it
without a 3.5 GB engine install, and so the connector module stays thin.
"""
