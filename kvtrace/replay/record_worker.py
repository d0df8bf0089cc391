"""The record checks of one large trace, in a second process (replay, and each
input of diff).

Replay without the content check spends about half its time checking and
decoding records (docs/bad-input.md) and half replaying them. So for a large
trace, a worker process reads the same file on its own and checks every record
as any reader does, while the main process decodes the same records without
checks (trace/trusted.py) and replays them:

    worker process: read + check records          -> "checked through line N"
    main process:   read JSON -> decode unchecked -> reference scheduler -> compare

The main process never acts on a record the worker has not passed: before it
decodes the record at line L, it waits until the worker has checked line L
(``TraceReader.checked_elsewhere``). Where the worker finds a bad record, the
main process raises the worker's error when it reaches that line, so replay
stops with the same one-line error, at the same line, as in one process. Both
read the same file (the worker through the main process's descriptor of it), so
they see the same cut in a truncated trace.

A worker that stops before a line the main process needs is an error
(``RecordWorkerError``), never a clean replay, except when it read the whole
file and the file has grown since (a trace still being written): the main
process then stops where the worker did, with the worker's cut, as one process
reading the file at that moment would have.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from kvtrace._child import spawn, stop, worker_main
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace.io import ReadShorter

from .workers import WorkerError

_REPORT_EVERY = 256   # records between reports from the worker


class RecordWorkerError(WorkerError):
    """The worker stopped before it had checked a record the main process reached."""


class RecordWorker:
    """The gate ``TraceReader.checked_elsewhere`` reads through: a worker process
    that checks the records of ``path``."""

    def __init__(self, path: str | os.PathLike, fileno: int | None = None):
        """``fileno``: the descriptor of this process's reader of ``path``; the
        worker then reads the very file it reads (``SharedFile``)."""
        self.path = str(Path(path))   # as TraceReader names it
        self._proc, self._conn = spawn("kvtrace.replay.record_worker", self.path, share=fileno)
        self.through = 0            # the worker has checked every record up to this line
        self._end: dict | None = None

    def wait(self, line: int) -> None:
        """Return once the worker has checked the record at ``line``. Raise the
        worker's TraceError if it found a bad record at or before ``line``."""
        while self.through < line:
            if self._end is not None:
                self._stopped()
            self._receive()

    def close(self) -> None:
        stop(self._proc, self._conn)

    def _receive(self) -> None:
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._end = {"through": self.through, "line": None, "problem": None,
                         "bug": f"its process ended (exit code {self._proc.wait()})"}
            return
        if kind == "through":
            self.through = value
        else:   # ("end", report)
            self._end = value
            self.through = max(self.through, value["through"])

    def _stopped(self):
        end = self._end
        if end["problem"] is not None:
            raise TraceError(self.path, end["line"], end["problem"])
        if end["bug"] is not None:
            raise RecordWorkerError(f"the record check stopped after line {end['through']} of the "
                                    f"trace: {end['bug']}")
        raise ReadShorter(end["through"], end.get("truncation"))


# --------------------------------------------------------------------------- the worker


def _serve(path: str, fd: int | None, conn: Connection) -> list[tuple]:
    """The worker process: read the trace (descriptor ``fd``, or else ``path``)
    as any reader does; report to ``conn`` ("through", line) now and then, for
    the last record checked. Returns the last report, ("end", report): the last
    record checked, and what stopped the check early (a bad record's line and
    problem, or a bug)."""
    report = {"through": 0, "line": None, "problem": None, "bug": None}
    reader = None
    try:
        reader = TraceReader(path, fd=fd)
        with reader:
            for n, _ in enumerate(reader, 1):
                report["through"] = reader.last_line
                if not n % _REPORT_EVERY:
                    conn.send(("through", reader.last_line))
        report["truncation"] = reader.truncation
    except TraceError as e:
        report.update(line=e.line, problem=e.problem)
    except Exception as e:   # a bug
        report["bug"] = f"{type(e).__name__}: {e}"
    return [("end", report)]


if __name__ == "__main__":
    sys.exit(worker_main(_serve, sys.argv[1:]))
