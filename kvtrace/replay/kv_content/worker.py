"""The content check of one large trace, in a second process.

Replay spends more time in the shadow-KV content check than in the reference
scheduler, and the check needs nothing the reference computes: it uses only the
recording (see check.py). So for a large trace, replay runs the check in a
worker process that reads the same file on its own, beside the main process:

    main process:   read + check records -> reference scheduler -> compare
    worker process: read JSON            -> ContentCheck          -> results

The main process checks every record (docs/reference/bad-input.md); the worker decodes
them with their own checks and those of order too (one reader), and trusts
the main process with the checks across records. A record the main process refuses ends the
replay there, with the main process's error, whatever the worker made of it.
With ``validate`` (one worker, on two cores), the worker runs the checks
across records as well, and the main process hands those over once the worker
has caught up (``TraceReader.checked_elsewhere``): the worker's verdict on a
record is then the one replay reports.

The worker reports in step order, per step: (line, divergences or None, slots
checked so far, states checked so far, loads assumed so far). The main process pairs each of its own
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

import contextlib
import os
import sys
from array import array
from collections import deque
from pathlib import Path
from multiprocessing.connection import Connection

from kvtrace.workers.child import spawn, stop, worker_main
from kvtrace.findings import Divergence
from kvtrace.trace import events as ev
from kvtrace.trace import TraceError

from kvtrace.workers import WorkerError

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

    def __init__(self, path: str | os.PathLike, device: str = "auto",
                 shared: tuple[int, int] | None = None, validate: bool = False,
                 session_keeps_sampled: bool = False):
        """``shared``: from the main process's reader of ``path``
        (``TraceReader.share``); the worker then reads the very bytes it reads. With
        ``validate`` the worker runs the checks across records as well, and this
        is a gate for
        ``TraceReader.checked_elsewhere``. ``session_keeps_sampled``: as
        ``ContentCheck``'s."""
        self.path = str(Path(path))   # as TraceReader names it
        self._proc, self._conn = spawn("kvtrace.replay.kv_content.worker", self.path, device,
                                       "1" if validate else "0",
                                       "1" if session_keeps_sampled else "0",
                                       share=shared or ())
        self.through = 0   # the checks across records have passed every line up to this one
        self._last_needed: int | None = None   # once replay has stopped: the last step it needs
        self._tags: deque[tuple[int, object]] = deque()   # (line, tag) of steps replayed here
        self._results: deque[tuple] = deque()   # the worker's, per step, not matched yet
        self._last = 0                          # the line of the worker's last result
        self._end: dict | None = None
        # What ContentCheck offers after a replay, as of the last step replayed here.
        self.assumed_loads = False
        self.slots_checked = 0
        self.states_checked = 0
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
        raise ContentWorkerError(f"the content check stopped at line {line} of the trace: "
                                 f"{error or 'it found the end of the file there'}")

    def stop_after(self) -> None:
        """Replay has stopped (an engine assertion): results for steps after the
        ones replayed so far are dropped as they come. The worker's checks
        across records are still waited for, as far as the main process reads."""
        self._last_needed = self._tags[-1][0] if self._tags else 0

    # The gate: see TraceReader.checked_elsewhere. Once the worker has caught
    # up, it runs the checks across records, and the main process leaves them.

    def takes_over(self, line: int) -> bool:
        """Whether the worker's checks across records take over at ``line``:
        once they have passed it (as far as its reports read so far say)."""
        return self.through >= line

    def wait(self, line: int) -> None:
        """Return once the worker's checks across records have passed ``line``.
        Raise the TraceError of a record they refuse at or before ``line``."""
        while self.through < line:
            if self._end is not None:
                problem = self._end.get("problem")
                if problem is not None:
                    raise TraceError(self.path, *problem)
                self._failed()
            self._receive()

    def close(self) -> None:
        stop(self._proc, self._conn)

    def _receive(self) -> None:
        try:
            msg = self._conn.recv()
        except EOFError:
            self._end = {"line": self._last, "error": f"its process ended (exit code {self._proc.wait()})"}
            return
        if msg[0] == "ready":
            if self._last_needed is None:
                self._results.extend(msg[1])
            else:
                self._results.extend(r for r in msg[1] if r[0] <= self._last_needed)
            if msg[1]:
                self._last = msg[1][-1][0]
            self.through = msg[2]
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
            at, divs, self.slots_checked, self.states_checked, self.assumed_loads = \
                results.popleft()
            if at != line:
                raise ContentWorkerError(f"the content check's result for line {at} came where "
                                         f"line {line} was expected")
            if divs:
                out.append((tag, divs))
        return out


# --------------------------------------------------------------------------- the worker


def _serve(path: str, device: str, validate: str, keeps_sampled: str,
           shared: tuple[int, int] | None, conn: Connection) -> list[tuple]:
    """The worker process: check the trace ``path``; report to ``conn``, per step,
    (line, divergences or None, slots and states checked so far, loads assumed so
    far), and
    with ``validate`` ("1") run the checks across records too, and report the
    last line they passed. Returns the last reports: the results not sent yet, and
    ("end", report)."""
    from kvtrace.trace.io import TraceReader

    from .check import ContentCheck

    if device != "numpy":   # torch's backends
        import torch

        torch.set_num_threads(1)   # the main process has the other core
    worker = _Worker(conn, device, validate == "1")
    reader = None
    try:
        reader = TraceReader(path, validate=worker.validate, shared=shared)
        worker.start(ContentCheck(reader.header.config, device,
                                  reader.header.features.async_scheduling is True,
                                  keep_counts=True, session_keeps_sampled=keeps_sampled == "1",
                                  groups=reader.header.features.kv_cache_groups))
        with _no_autograd(device):
            worker.read(reader)
    except Exception as error:   # a record the main process refuses, or a bug
        # The record that raised: the steps before it count.
        worker.failed(reader.last_line if reader is not None else 0, f"{type(error).__name__}: {error}")
    return worker.last_reports()


class WholeCheck:
    """The content check of a whole trace run in this process as the worker
    runs it (``check_whole``), its reports kept rather than sent: per step, in
    step order, its line, the slots and states checked and whether loads were
    assumed so far (as the step was queued), and its divergences where it has
    any (by the step's place in that order)."""

    def __init__(self) -> None:
        self.device: str | None = None   # None: the check never started
        self.lines = array("q")
        self.slots = array("q")
        self.states = array("q")
        self.assumed = bytearray()
        self.found: dict[int, list[Divergence]] = {}
        self.end: dict | None = None     # the worker's end report (where and why it stopped)

    def send(self, msg: tuple) -> None:
        """A message the worker would send (``_Worker``)."""
        if msg[0] == "device":
            self.device = msg[1]
        elif msg[0] == "ready":
            for line, divs, slots, states, assumed in msg[1]:
                if divs:
                    self.found[len(self.lines)] = divs
                self.lines.append(line)
                self.slots.append(slots)
                self.states.append(states)
                self.assumed.append(bool(assumed))
        else:
            self.end = msg[1]


def check_whole(path: str, device: str, session_keeps_sampled: bool = False) -> WholeCheck:
    """The content check of the whole trace ``path``, in this process, as the
    worker runs it (it trusts another reader with the checks across records)."""
    kept = WholeCheck()
    for msg in _serve(path, device, "0", "1" if session_keeps_sampled else "0", None, kept):
        kept.send(msg)
    return kept


class _Worker:
    """The worker's check and what it tells the main process, one method per
    message: ("device", name) once the check has started (``start``),
    ("ready", results, through) every ``_REPORT_EVERY`` records
    (``send_ready``), and last the results not sent yet and ("end", report)
    (``last_reports``)."""

    def __init__(self, conn: Connection, device: str, validate: bool):
        self.conn, self.device, self.validate = conn, device, validate
        self.check = None
        # line: where the check stopped (the last line read when it did not), and
        # error: why, or None. through: the last line the checks across records
        # passed; problem: [line, what] for a record they refuse.
        self.report = {"line": 0, "error": None, "through": 0, "problem": None}
        self.queued: deque[int] = deque()   # the line of each step given to the check, not reported yet
        self.done: list[tuple] = []

    def start(self, check) -> None:
        self.check = check
        self.conn.send(("device", check.device))

    def send_ready(self) -> None:
        self.conn.send(("ready", self.done[:], self.report["through"]))
        self.done.clear()

    def last_reports(self) -> list[tuple]:
        return [("ready", self.done, self.report["through"]), ("end", self.report)]

    def read(self, reader) -> None:
        """Give each record of ``reader`` to the check, until the trace ends or
        a record the reader refuses."""
        report, ready, queued = self.report, self.ready, self.queued
        line = 0
        try:
            for n, e in enumerate(reader, 1):
                line = reader.last_line
                if self.check is not None:
                    try:
                        _check(self.check, e, line, queued, ready)
                    except Exception as error:   # a record the main process refuses, or a bug
                        self.stop_check(line, f"{type(error).__name__}: {error}")
                        if not self.validate:
                            break
                if self.validate:
                    report["through"] = line
                if not n % _REPORT_EVERY:
                    self.send_ready()
        except TraceError as problem:   # the main process stops before this record
            report["problem"] = [problem.line, problem.problem]
            line = problem.line
        if self.check is not None:
            if report["problem"] is None:
                ready(self.check.flush())
                report["line"] = line
            else:
                self.stop_check(line, "a record the checks it shares refuse")

    def ready(self, results: list) -> None:
        """The check's results for steps queued before, to be sent."""
        for line, divs in results:
            at = self.queued.popleft()
            slots, states, assumed = self.check.counts.popleft()   # as the step was queued
            self.done.append((at, divs or None, slots, states, assumed))

    def stop_check(self, line: int, error: str) -> None:
        """The check stops before ``line``: the steps queued before it still count."""
        self.report.update(line=line, error=error)
        try:
            with _no_autograd(self.device):   # the shadow cache's tensors were made in it
                self.ready([r for r in self.check.flush() if r[0] < line])
        except Exception:
            pass
        self.check = None

    def failed(self, line: int, error: str) -> None:
        """What stopped the worker outside its check's own steps."""
        if self.check is not None:
            self.stop_check(line, error)
        else:
            self.report.update(line=line, error=error)


def _no_autograd(device: str):
    """torch's inference mode, for torch's backends."""
    if device == "numpy":
        return contextlib.nullcontext()
    import torch

    return torch.inference_mode()


def _check(check, e: ev.Event, line: int, queued: deque, ready) -> None:
    """Give one record's event to the check."""
    kind = type(e)
    if kind is ev.Step:
        results = check.step(e, line, line)
        queued.append(line)
        ready(results)
    elif kind is ev.Output:
        check.output(e)
    elif kind is ev.Arrival:
        check.arrival(e)
    elif kind is ev.Abort:
        check.abort(e.reqs)


if __name__ == "__main__":
    sys.exit(worker_main(_serve, sys.argv[1:]))
