"""Many traces and segment directories replayed into one report: one item of
the work and its answer (items.py), and the items run as Ray tasks on a
cluster (on_ray.py). A pool of this machine's processes runs the same items
(kvtrace/replay/many.py)."""
