"""Recording real engines' scheduler decisions (vLLM V1)."""
