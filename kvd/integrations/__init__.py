"""Engine integrations: glue that lets an unmodified inference engine use kvd.

``kvd.integrations.vllm`` is the vLLM connector (imports vLLM);
``kvd.integrations.vllm_core`` is its engine-free logic (importable and
unit-tested without vLLM installed).
"""
