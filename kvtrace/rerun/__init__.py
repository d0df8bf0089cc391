"""A trace's inputs re-run through vLLM's own ``Scheduler`` (``kvtrace replay
--scheduler vllm``): ``core`` drives it step by step and diffs what it decided
with the recording; ``build`` makes the scheduler, its config and the scripted
connector from the trace's header.
"""
