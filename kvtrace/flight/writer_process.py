"""The vLLM recorder's writer process with keyframes:
``python -m kvtrace.flight.writer_process --detach --keyframe-every N PATH FD RING``.

The recorder starts it instead of ``kvtrace.record.writer_process`` when
``KVTRACE_KEYFRAME_EVERY=N`` is set (``kvtrace.record.sink``). It is that
process, its records passed through a ``KeyframingWriter``: the replay that
makes the keyframes runs here, outside the engine's process.
"""

from __future__ import annotations

import sys

from kvtrace.record import writer_process

from .writer import KeyframingWriter


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    every = None
    if "--keyframe-every" in argv:
        i = argv.index("--keyframe-every")
        every = int(argv[i + 1])
        del argv[i:i + 2]
    wrap = None if every is None else (lambda w, header: KeyframingWriter(w, header, every))
    return writer_process.main(argv, wrap)


if __name__ == "__main__":
    sys.exit(main())
