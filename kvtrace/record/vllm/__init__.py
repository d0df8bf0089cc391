"""Recording vLLM V1: the code that runs inside a user's vLLM, and nothing else.

- ``plugin``: vLLM's general-plugin hook; switches recording on in any vLLM
  process when ``KVTRACE_OUT`` is set.
- ``hooks``: the recording subclass of vLLM's ``Scheduler``; ``recorder``: what
  it captures of each call; ``call_sites``: the connector's answers, taken at
  the scheduler's call sites; ``header``: the trace's header; ``kv_audit``:
  the KV bytes a connector moves (the data-path checks).

Replay through vLLM's own scheduler is ``kvtrace.rerun``; the drivers,
workloads, tiny models and faults that run vLLM for tests and benches are
``kvtrace.lab``.
"""
