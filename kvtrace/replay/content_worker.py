"""The content check of one large trace, in a second process.

Replay spends more time in the shadow-KV content check than in the reference
scheduler, and the check needs nothing the reference computes: it uses only the
recording (see content.py). So for a large trace, replay runs the check in a
worker process that reads the same file on its own, beside the main process:

    main process:   read + check records -> reference scheduler -> compare
    worker process: read JSON            -> ContentCheck          -> results

The main process checks every record (docs/bad-input.md); the worker trusts
that check and decodes records without checking them (trace/trusted.py). A
record the main process refuses ends the replay there, with the main process's
error, whatever the worker made of it.

The worker reports in step order, per step: (line, divergences or None, slots
checked so far, loads assumed so far). The main process pairs each of its own
steps with the worker's result for the same line and gives its divergences the
place they would have had with the check in process (``ContentWorker.step``
returns what ``ContentCheck.step`` returns), so a replay reports the same
divergences, in the same order and words, and the same counts, either way.
Once the main process has every result it needs (a replay stopped at an
engine assertion needs none past the stop), it stops the worker. A worker that stops before a step the main
process replayed is an error (``ContentWorkerError``), never a clean replay.

Memory stays bounded on both sides: the main process reads only a bounded
number of results ahead of its own steps (a worker that is ahead then waits on
the pipe), and waits for the worker when it is ``MAX_LAG`` steps ahead.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from multiprocessing.connection import Connection

from kvtrace._child import spawn, stop, worker_main
from kvtrace.findings import Divergence
from kvtrace.trace import events as ev
from kvtrace.trace import trusted

from .workers import ENV, WorkerError

# Steps the main process may be ahead of the worker before it waits for results,
# and results of the worker it reads ahead of its own steps.
MAX_LAG = 1 << 16
MAX_AHEAD = 1 << 13
_REPORT_EVERY = 2048             # records between reports from the worker


class ContentWorkerError(WorkerError):
    """The worker failed on a record the main process accepted."""


class ContentWorker:
    """``ContentCheck``'s interface, with the check running in a worker process
    that reads the trace ``path`` itself."""

    def __init__(self, path: str | os.PathLike, device: str = "auto", fileno: int | None = None):
        """``fileno``: the descriptor of the main process's reader of ``path``; the
        worker then reads the very file it reads (``SharedFile``)."""
        self._proc, self._conn = spawn("kvtrace.replay.content_worker", str(path), device, share=fileno)
        self._tags: deque[tuple[int, object]] = deque()   # (line, tag) of steps replayed here
        self._results: deque[tuple] = deque()   # the worker's, per step, not matched yet
        self._last = 0                          # the line of the worker's last result
        self._end: dict | None = None
        # What ContentCheck offers after a replay, as of the last step replayed here.
        self.assumed_loads = False
        self.slots_checked = 0
        self.device: str | None = None

    # The worker reads these inputs from the file itself.
    def arrival(self, a: ev.Arrival) -> None:
        pass

    def abort(self, reqs: list[str]) -> None:
        pass

    def output(self, rec: ev.Output) -> None:
        pass

    def step(self, rec: ev.Step, line: int, tag: object = None
             ) -> list[tuple[object, list[Divergence]]]:
        """Note the step's place; returns the steps the worker has checked
        meanwhile, as (tag, divergences) in step order, like ContentCheck.step."""
        self._tags.append((line, tag))
        # Read only what is needed: a worker that is ahead then waits on the pipe,
        # so that its results do not pile up here.
        while self._end is None and len(self._results) < MAX_AHEAD and self._conn.poll():
            self._receive()
        out = self._match()
        if self._end is not None and self._tags:
            self._failed()   # the worker is done, and has no result for this step
        while len(self._tags) > MAX_LAG and self._end is None:   # the worker is behind
            self._receive()
            out += self._match()
        return out

    def flush(self) -> list[tuple[object, list[Divergence]]]:
        """Wait for the worker's results for every step replayed here; returns
        those not returned yet. The rest of the worker's work is not needed (a
        replay that stopped early): ``close`` stops it."""
        out = self._match()
        while (self._tags or self.device is None) and self._end is None:
            self._receive()
            out += self._match()
        if self._tags or self.device is None:   # steps never checked, or no check at all
            self._failed()
        return out

    def _failed(self):
        if self._end is None:
            self._end = {"line": self._last, "error": "no report"}
        line, error = self._end["line"], self._end["error"]
        if error is None:   # it read the whole file, and the file was shorter
            raise ContentWorkerError(
                f"the trace grew after line {line} while it was replayed (is it still being "
                f"written?): replay it once it is complete, or with {ENV}=0")
        raise ContentWorkerError(f"the content check stopped at line {line} of the trace: {error}")

    def close(self) -> None:
        stop(self._proc, self._conn)

    def _receive(self) -> None:
        try:
            msg = self._conn.recv()
        except EOFError:
            self._end = {"line": self._last, "error": f"its process ended (exit code {self._proc.wait()})"}
            return
        if msg[0] == "ready":
            self._results.extend(msg[1])
            if msg[1]:
                self._last = msg[1][-1][0]
        elif msg[0] == "device":
            self.device = msg[1]
        else:   # ("end", report)
            self._end = msg[1]

    def _match(self) -> list[tuple[object, list[Divergence]]]:
        """Pair the steps replayed here with the worker's results, in order."""
        out = []
        tags, results = self._tags, self._results
        while tags and results:
            line, tag = tags.popleft()
            at, divs, self.slots_checked, self.assumed_loads = results.popleft()
            if at != line:
                raise ContentWorkerError(f"the content check's result for line {at} came where "
                                         f"line {line} was expected")
            if divs:
                out.append((tag, divs))
        return out


# --------------------------------------------------------------------------- the worker


def _serve(path: str, device: str, fd: int | None, conn: Connection) -> list[tuple]:
    """The worker process: check the trace ``path``; report to ``conn``, per step,
    (line, divergences or None, slots checked so far, loads assumed so far).
    Returns the last reports: the results not sent yet, and ("end", report)."""
    import torch

    from kvtrace.trace.io import TraceReader

    from .content import ContentCheck

    torch.set_num_threads(1)   # the main process has the other core
    report = {"line": 0, "error": None}
    queued: deque[tuple[int, int, bool]] = deque()   # per step queued: line, counts then
    done: list[tuple] = []

    def ready(results: list) -> None:
        for line, divs in results:
            at, slots, assumed = queued.popleft()
            done.append((at, divs or None, slots, assumed))

    def send() -> None:
        conn.send(("ready", done[:]))
        done.clear()

    line = 0
    try:
        reader = TraceReader(path, validate=False, fd=fd)
        check = ContentCheck(reader.header.config, device)
        conn.send(("device", check.device))
        with torch.inference_mode():
            for n, (line, obj) in enumerate(reader.records(), 1):
                kind = obj.get("kind")
                if kind == "step":
                    results = check.step(trusted.step(obj), line, line)
                    queued.append((line, check.slots_checked, check.assumed_loads))
                    ready(results)
                elif kind == "output":
                    check.output(trusted.output(obj))
                elif kind == "arrival":
                    check.arrival(trusted.decode(obj))
                elif kind == "abort":
                    check.abort(obj["reqs"])
                if not n % _REPORT_EVERY:
                    send()
            ready(check.flush())
    except Exception as e:   # a record the main process refuses, or a bug
        report["error"] = f"{type(e).__name__}: {e}"
        try:   # the steps queued before the failing record still count
            with torch.inference_mode():   # the shadow cache's tensors were made in it
                ready([r for r in check.flush() if r[0] < line])
        except Exception:
            pass
    report["line"] = line
    return [("ready", done), ("end", report)]


if __name__ == "__main__":
    sys.exit(worker_main(_serve, sys.argv[1:]))
