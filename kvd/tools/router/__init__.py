"""`kvd router`: an OpenAI-compatible prefill/decode router for vLLM engines (``app``)."""
