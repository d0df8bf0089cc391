"""A local Ray cluster for the tests of one module: started once, as
``kvtrace replay --ray`` starts its own (kvtrace.fleet.on_ray.connected), and
shut down after the module. While it runs, ``--ray`` in this process uses it."""

from __future__ import annotations

from tests._require import require


def local_cluster():
    """A generator for a module-scoped fixture: yields Ray's GCS address."""
    ray = require("ray", "Ray is not installed (the [ray] extra): these tests run replay on a "
                         "local Ray cluster")
    from kvtrace.fleet.on_ray import connected

    with connected("local"):
        yield ray.get_runtime_context().gcs_address
