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

# Use a worker for files at least this large. A worker's start (a fresh
# interpreter) costs from a tenth of a second to a second (torch).
# - With the content check: bytes on disk.
MIN_BYTES = 8 << 20
# - The record checks alone: bytes of trace text. On two cores a record worker
#   paid from about 25 MB of text on (plain, gzip and zstd files alike: bench
#   numbers in docs/performance.md, "Worker processes").
MIN_TEXT_BYTES = 24 << 20
# A compressed file's text, estimated: kvtrace's traces compress 13-17x with
# gzip or zstd; the estimate errs small.
COMPRESSION = 12
ENV = "KVTRACE_REPLAY_WORKER"   # "0", "1" or "2" workers; unset: by size and cores


class WorkerError(RuntimeError):
    """A worker stopped before it had done what replay needed of it."""


def wanted(path: str | os.PathLike, content: bool = True) -> int:
    """How many workers replay of ``path`` should use: 0; 1 (the content check's
    when it is on, else the record checks'); or 2 (the record checks' as well,
    beside the content check's; without the content check, 2 is 1).
    ``content``: the content check runs (False: the record checks alone)."""
    choice = os.environ.get(ENV, "").strip()
    if choice in ("0", "1", "2"):
        return int(choice)
    try:
        st = os.stat(path)
    except OSError:
        return 0
    cores = os.cpu_count() or 1
    # Traces replayed in parallel already use every core.
    if not stat.S_ISREG(st.st_mode) or cores < 2 or multiprocessing.parent_process():
        return 0
    if content and st.st_size < MIN_BYTES:
        return 0
    if not content and text_bytes(path, st.st_size) < MIN_TEXT_BYTES:
        return 0
    # Two workers beside the main process only pay on a third core: on two, the
    # record checks' worker and the main process's decoding read the file twice
    # for no gain (docs/performance.md).
    return 2 if cores >= 3 else 1


def text_bytes(path: str | os.PathLike, size: int) -> int:
    """The bytes of trace text a file of ``size`` bytes on disk holds: as many,
    or ``COMPRESSION`` times as many when it starts with gzip's or zstd's magic."""
    from kvtrace.trace.files import GZIP_MAGIC, is_zstd

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return size
    return size * COMPRESSION if magic[:2] == GZIP_MAGIC or is_zstd(magic) else size
