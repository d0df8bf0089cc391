"""The content check of one large trace, in a second process.

Replay spends more time in the shadow-KV content check than in the reference
scheduler, and the check needs nothing the reference computes: it uses only the
recording (see content.py). So for a large trace, replay runs the check in a
worker process that reads the same file on its own, beside the main process:

    main process:   read + check records -> reference scheduler -> compare
    worker process: read JSON            -> ContentCheck          -> results

The main process checks every record (docs/bad-input.md); the worker trusts
that check and only decodes the fields the content check reads, without
validating them. A record the main process refuses ends the replay there, with
the main process's error, whatever the worker made of it.

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

import multiprocessing
import os
import signal
import stat
import subprocess
import sys
from collections import deque
from multiprocessing.connection import Connection

from kvtrace._child import child_env
from kvtrace.findings import Divergence
from kvtrace.trace import events as ev

# Use the worker for files at least this large (bytes on disk); the worker's start
# (a fresh interpreter importing torch) costs about a second.
MIN_BYTES = 8 << 20
ENV = "KVTRACE_CONTENT_WORKER"   # "1": always, "0": never; unset: by size
# Steps the main process may be ahead of the worker before it waits for results,
# and results of the worker it reads ahead of its own steps.
MAX_LAG = 1 << 16
MAX_AHEAD = 1 << 13
_REPORT_EVERY = 2048             # records between reports from the worker


def wanted(path: str | os.PathLike) -> bool:
    """Whether replay of ``path`` should run the content check in a worker."""
    choice = os.environ.get(ENV, "").strip()
    if choice in ("0", "1"):
        return choice == "1"
    try:
        st = os.stat(path)
    except OSError:
        return False
    big = stat.S_ISREG(st.st_mode) and st.st_size >= MIN_BYTES
    return big and (os.cpu_count() or 1) >= 2 and not multiprocessing.parent_process()


class ContentWorkerError(RuntimeError):
    """The worker failed on a record the main process accepted."""


class ContentWorker:
    """``ContentCheck``'s interface, with the check running in a worker process
    that reads the trace ``path`` itself."""

    def __init__(self, path: str | os.PathLike, device: str = "auto"):
        theirs, mine = os.pipe()[::-1]
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvtrace.replay.content_worker", str(path), device, str(theirs)],
                stdin=subprocess.DEVNULL, pass_fds=(theirs,), env=child_env())
        except BaseException:
            os.close(mine)
            raise
        finally:
            os.close(theirs)
        self._conn = Connection(mine, writable=False)
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
        if self._proc.poll() is None:
            self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

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


def _serve(path: str, device: str, conn: Connection) -> None:
    """The worker process: check the trace ``path``; report to ``conn``, per step,
    (line, divergences or None, slots checked so far, loads assumed so far)."""
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
        reader = TraceReader(path, validate=False)
        check = ContentCheck(reader.header.config, device)
        conn.send(("device", check.device))
        with torch.inference_mode():
            for n, (line, obj) in enumerate(reader.records(), 1):
                kind = obj.get("kind")
                if kind == "step":
                    results = check.step(_step(obj), line, line)
                    queued.append((line, check.slots_checked, check.assumed_loads))
                    ready(results)
                elif kind == "output":
                    check.output(_output(obj))
                elif kind == "arrival":
                    check.arrival(_arrival(obj))
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
    try:
        send()
        conn.send(("end", report))
        conn.close()
    except OSError:   # the main process is gone
        pass


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the main process stops it
    path, device, fd = argv
    _serve(path, device, Connection(int(fd), readable=False))
    return 0


# Records as the main process has checked them: built without checks, with only
# the fields the content check reads filled in faithfully.

def _arrival(d: dict) -> ev.Arrival:
    return ev.Arrival(d["seq"], d["req"], d["prompt_token_ids"], d["max_tokens"])


def _state(d: dict) -> ev.RequestState:
    return ev.RequestState(d["req"], d["status"], d["num_computed_tokens"], d["num_tokens"],
                           d["num_preemptions"], d["block_ids"])


def _new(d: dict) -> ev.ScheduledNew:
    return ev.ScheduledNew(d["req"], d["num_computed_tokens"], d["num_scheduled_tokens"],
                           d["block_ids"])


def _running(d: dict) -> ev.ScheduledRunning:
    return ev.ScheduledRunning(d["req"], d["num_computed_tokens"], d["num_scheduled_tokens"],
                               d["new_block_ids"])


def _step(d: dict) -> ev.Step:
    loads = d.get("loads")
    return ev.Step(
        d["seq"], d["step"],
        [_new(x) for x in d.get("new", ())],
        [_new(x) for x in d.get("resumed", ())],
        [_running(x) for x in d.get("running", ())],
        d.get("preempted", []), d.get("finished", []),
        [ev.Lookup.from_json(x) for x in d.get("lookups", ())],
        None if loads is None else [ev.KVLoad(x["req"], x["start"], x["end"]) for x in loads],
        [_state(x) for x in d.get("states", ())],
    )


def _output(d: dict) -> ev.Output:
    return ev.Output(d["seq"], d["step"], d.get("sampled", {}), None, d.get("finished", {}),
                     [_state(x) for x in d.get("states", ())])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
