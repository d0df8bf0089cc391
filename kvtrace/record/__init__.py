"""Recording an engine's scheduler decisions into a trace.

``sink`` and ``writer_process`` are engine-agnostic: they take what a
recorder captured and write it, off the engine's thread, into a trace.
``vllm/`` is the recorder for vLLM V1 and everything that drives a vLLM engine.
"""
