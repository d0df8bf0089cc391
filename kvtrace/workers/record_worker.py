"""The record checks of one large trace, in a second process (replay, and each
input of diff).

Replay without the content check spends about half its time checking and
decoding records (docs/reference/bad-input.md) and half replaying them. So for a large
trace, a worker process reads the same file on its own and checks every record
as any reader does, while the main process decodes the same records (their
own checks come with decoding, and it checks their order) without the checks
across records, and replays them:

    worker process: read + check records          -> "checked through line N"
    main process:   read + decode records         -> reference scheduler -> compare

The main process never acts on a record the worker has not passed: before it
decodes the record at line L, it waits until the worker has checked line L
(``TraceReader.checked_elsewhere``). Where the worker finds a bad record, the
main process raises the worker's error when it reaches that line, so replay
stops with the same one-line error, at the same line, as in one process. Both
read the same bytes (``TraceReader.share``): the same open file, up to the same
end even when something still appends to it, so they see the same cut in a
truncated trace and in one still being written.

A worker that stops before a line the main process needs is an error
(``RecordWorkerError``), never a clean replay.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from .child import spawn, stop, worker_main
from kvtrace.trace import TraceError, TraceReader

from .policy import WorkerError

_REPORT_EVERY = 256   # records between reports from the worker


class RecordWorkerError(WorkerError):
    """The worker stopped before it had checked a record the main process reached."""


class RecordWorker:
    """The gate ``TraceReader.checked_elsewhere`` reads through: a worker process
    that checks the records of ``path``."""

    def __init__(self, path: str | os.PathLike, shared: tuple[int, int] | None = None):
        """``shared``: from this process's reader of ``path`` (``TraceReader.share``);
        the worker then reads the very bytes it reads."""
        self.path = str(Path(path))   # as TraceReader names it
        self._proc, self._conn = spawn("kvtrace.workers.record_worker", self.path, share=shared or ())
        self.through = 0            # the worker has checked every record up to this line
        self._end: dict | None = None

    def takes_over(self, line: int) -> bool:
        """The worker checks every record: it takes the checks across records
        over from the first."""
        return True

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
        raise RecordWorkerError(f"the record check stopped after line {end['through']} of the "
                                f"trace: {end['bug'] or 'it found the end of the file there'}")


# --------------------------------------------------------------------------- the worker


def _serve(path: str, shared: tuple[int, int] | None, conn: Connection) -> list[tuple]:
    """The worker process: read the trace (through ``shared``, or else ``path``)
    as any reader does; report to ``conn`` ("through", line) now and then, for
    the last record checked. Returns the last report, ("end", report): the last
    record checked, and what stopped the check early (a bad record's line and
    problem, or a bug)."""
    report = {"through": 0, "line": None, "problem": None, "bug": None}
    try:
        reader = TraceReader(path, shared=shared)
        with reader:
            for n, _ in enumerate(reader, 1):
                report["through"] = reader.last_line
                if not n % _REPORT_EVERY:
                    conn.send(("through", reader.last_line))
    except TraceError as e:
        report.update(line=e.line, problem=e.problem)
    except Exception as e:   # a bug
        report["bug"] = f"{type(e).__name__}: {e}"
    return [("end", report)]


if __name__ == "__main__":
    sys.exit(worker_main(_serve, sys.argv[1:]))
