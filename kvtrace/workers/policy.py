"""How many worker processes replay splits a trace's work across.

On a large trace, replay runs part of its work in worker processes that read
the same file on their own: the shadow-KV content check when it is on
(kv_content/worker.py), and the record checks (record_worker.py) when the check is
off, or beside the content check's worker on a machine with three or more
cores. The report is the same either way; only the time differs.
"""

from __future__ import annotations

import multiprocessing
import os
import stat

# Use a worker for files at least this large (bytes on disk): a worker's start (a
# fresh interpreter) costs from a tenth of a second to a second (torch).
MIN_BYTES = 8 << 20
ENV = "KVTRACE_REPLAY_WORKER"   # "0", "1" or "2" workers; unset: by size and cores


class WorkerError(RuntimeError):
    """A worker stopped before it had done what replay needed of it."""


def wanted(path: str | os.PathLike) -> int:
    """How many workers replay of ``path`` should use: 0; 1 (the content check's
    when it is on, else the record checks'); or 2 (the record checks' as well,
    beside the content check's; without the content check, 2 is 1)."""
    choice = os.environ.get(ENV, "").strip()
    if choice in ("0", "1", "2"):
        return int(choice)
    try:
        st = os.stat(path)
    except OSError:
        return 0
    cores = os.cpu_count() or 1
    # Traces replayed in parallel already use every core.
    if not stat.S_ISREG(st.st_mode) or st.st_size < MIN_BYTES or cores < 2 \
            or multiprocessing.parent_process():
        return 0
    # Two workers beside the main process only pay on a third core: on two, the
    # record checks' worker and the main process's decoding read the file twice
    # for no gain (docs/performance.md).
    return 2 if cores >= 3 else 1
