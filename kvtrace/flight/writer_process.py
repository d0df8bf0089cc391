"""The vLLM recorder's writer process as a flight recorder:
``python -m kvtrace.flight.writer_process --detach [--keyframe-every N]
[--ring BYTES --segment BYTES] PATH FD RING``.

The recorder starts it instead of ``kvtrace.record.writer_process`` when
``KVTRACE_KEYFRAME_EVERY=N`` or ``KVTRACE_RING`` is set (``kvtrace.record.sink``).
It is that process, its records passed through a ``KeyframingWriter`` (a
keyframe before every N-th step) or, with ``--ring``, a ``SegmentWriter``:
PATH is then a directory of segments (FD, that directory, locked by the
engine's process, ``record.folder.open_folder``), which never holds more than
the ring. The replay that makes the keyframes, the invariant checks and the
triggers all run here, outside the engine's process; the lines that say
what a trigger pinned go to standard error, which is the engine's.
``kvtrace dump PATH`` signals this process (its pid is in PATH/recorder.pid).
"""

from __future__ import annotations

import os
import signal
import sys

from kvtrace.record import writer_process

from .segments import flight_writer


def _take(argv: list[str], flag: str) -> int | None:
    """The number after ``flag`` in ``argv``, both taken out; None without it."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = int(argv[i + 1])
    del argv[i:i + 2]
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    every = _take(argv, "--keyframe-every")
    ring = _take(argv, "--ring")
    segment = _take(argv, "--segment")
    if ring is None and every is None:
        return writer_process.main(argv)

    def open_writer(path, header, fd):
        # With a ring, ``fd`` (the directory, locked) stays open until this
        # process ends: whoever started the engine waits on its lock.
        return flight_writer(path, header, every, ring, segment, on_pin=writer_process.say, fd=fd)

    wake_r = None
    if ring is not None:
        # A signal wakes the writer at once, though no record comes: a pin
        # asked while the engine idles is made then.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    return writer_process.main(argv, open_writer, wake_r)


if __name__ == "__main__":
    sys.exit(main())
