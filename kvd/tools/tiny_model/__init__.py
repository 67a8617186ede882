"""`kvd tiny-model DIR`: a tiny deterministic Llama that vLLM loads from disk (``llama``)."""
