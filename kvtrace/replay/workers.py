"""Whether replay splits a trace's work across two processes.

On a large trace, replay runs part of its work in a worker process that reads
the same file on its own: the shadow-KV content check when it is on
(content_worker.py), the record checks when it is off (record_worker.py). The
report is the same either way; only the time differs.
"""

from __future__ import annotations

import multiprocessing
import os
import stat

# Use a worker for files at least this large (bytes on disk): a worker's start (a
# fresh interpreter) costs from a tenth of a second to a second (torch).
MIN_BYTES = 8 << 20
ENV = "KVTRACE_REPLAY_WORKER"   # "1": always, "0": never; unset: by size


class WorkerError(RuntimeError):
    """A worker stopped before it had done what replay needed of it."""


def wanted(path: str | os.PathLike) -> bool:
    """Whether replay of ``path`` should use a worker process."""
    choice = os.environ.get(ENV, "").strip()
    if choice in ("0", "1"):
        return choice == "1"
    try:
        st = os.stat(path)
    except OSError:
        return False
    big = stat.S_ISREG(st.st_mode) and st.st_size >= MIN_BYTES
    # Traces replayed in parallel already use every core.
    return big and (os.cpu_count() or 1) >= 2 and not multiprocessing.parent_process()
