"""The kvd connector's logic, with no vLLM import: the scheduler half and the worker
half of ``KvdConnector``, how completions reach the step, re-registration after a
daemon restart, the keepalive, the settings, the geometry checks and the CUDA
allocator shim.

Kept apart from ``kvd.integrations.vllm`` (the thin layer that imports vLLM) so the
default test suite proves it without a 3.5 GB engine install. vLLM objects reach it
as plain values (``geometry``, ``hybrid``, ``messages``) or duck-typed requests.
"""
