"""Recording vLLM V1.

- ``plugin``: vLLM's general-plugin hook; switches recording on in any vLLM
  process when ``KVTRACE_OUT`` is set.
- ``hooks``: the recording subclass of vLLM's ``Scheduler``; ``recorder``: what
  it captures of each call; ``header``: the trace's header.
- ``run``: the drivers (offline engine, a recorded command; ``serve`` drives one
  step by step); ``workloads``: the stored workloads; ``random_workloads``:
  random ones; ``fault_schedulers``: bugs put back in.
- ``model_free``: a release's real engine core with no model; ``releases``
  runs it in a process of each installed release.
- ``rerun``: a trace's inputs re-run through vLLM's own ``Scheduler``
  (``kvtrace replay --scheduler vllm``), built by ``rerun_setup``.
- ``scripted_connector``, ``tiny_model``: a KV connector and a model for tests
  and workloads, built locally.
"""
