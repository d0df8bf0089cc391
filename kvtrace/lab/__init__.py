"""The lab: what runs vLLM for kvtrace's commands, tests and benches, never
inside a user's vLLM.

- ``run``: the drivers (an offline engine, a recorded command); ``serve``
  drives one step by step; ``model_free``: a release's real engine core with
  no model; ``releases`` and ``release_jobs``: the same in a process of each
  installed release.
- ``workloads``: the stored workloads; ``random_workloads``: random ones.
- ``fault_schedulers``, ``fault_connectors``: bugs put back in.
- ``scripted_connector``, ``tiny_model``: a KV connector and a model built
  locally.
- ``lmcache``: an LMCache server for a run; ``lmcache_connectors``: LMCache's
  multi-process connector as the KV audit reads it, and bugs put back in it.
"""
