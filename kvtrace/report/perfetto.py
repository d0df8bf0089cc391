"""Export a trace as Chrome trace-event JSON, which ui.perfetto.dev and
chrome://tracing open.

Time is the step index: a trace holds no times of its steps, so one scheduler
step is drawn as 1 ms, and step ``k`` covers ``[k, k+1)`` ms (the file's
timestamps are in microseconds, so ``k * 1000``). The file's metadata, its
process names and ``TIME_AXIS`` (which ``kvtrace export`` prints) say so.
Arrival times are not used: they are wall-clock stamps of the recording
machine and say nothing about the schedule.

* Process 1, "requests": one track (thread) per request, in arrival order, with
  slices ``waiting`` (arrival to admission), ``loading KV`` (an asynchronous load:
  from the step whose state says WAITING_FOR_REMOTE_KVS to the ``schedule()``
  after the output that reports it finished, ``finished_recving``, which takes
  the request out of it; a failed admission attempt with an asynchronous hit
  leaves it ``waiting``), ``prefill`` (one slice per chunk),
  ``decode`` (consecutive decode steps merged) and ``preempted`` (preemption to
  resumption). Slices on one track never overlap. Arrivals, synchronous loads,
  finishes and divergences are instant events on the request's track.
* Process 2, "scheduler": counter tracks ``free blocks``, ``KV blocks used``,
  ``scheduled tokens`` and ``running requests``; divergences that belong to no
  request are instant events here.

The file is written as the trace is read: memory grows with the live requests
only.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import IO, Iterable

import orjson

from .._text import path_text
from ..findings import Divergence
from ..writing import writing
from ..trace import events as ev
from ..trace.io import TraceReader
from .summary import phase_of

US_PER_STEP = 1000
# What the time axis means, in the metadata and on kvtrace export's stderr.
TIME_AXIS = ("the time axis counts scheduler steps: 1 ms = 1 step (a trace holds no times "
             "of its steps)")
STEP_NOTE = " (1 ms = 1 step)"   # after each process's name
REQUESTS_PID = 1
SCHEDULER_PID = 2


# The slice an unscheduled request's status puts it in.
_WAITING_PHASES = {"WAITING": "waiting", "WAITING_FOR_REMOTE_KVS": "loading KV",
                   "PREEMPTED": "preempted"}


class _Track:
    __slots__ = ("tid", "prompt_len", "num_tokens", "phase", "phase_start", "phase_args",
                 "decode_start", "decode_end", "decode_tokens", "cursor", "chunks")

    def __init__(self, tid: int, prompt_len: int, start: int):
        self.tid = tid
        self.prompt_len = prompt_len
        self.num_tokens = prompt_len
        self.phase: str | None = "waiting"       # waiting, loading KV, preempted, or None
        self.phase_start = start
        self.phase_args: dict = {}
        self.decode_start: int | None = None
        self.decode_end = 0
        self.decode_tokens = 0
        self.cursor = start                      # end of the last slice written (µs)
        self.chunks = 0


class _Exporter:
    def __init__(self, out: IO[bytes], header: ev.Header, divergences: Iterable[Divergence] | None,
                 checked: dict | None = None):
        self.out = out
        self.checked = checked or {}
        self.first = True
        self.header = header
        self.usable = header.config.num_blocks - 1
        self.tracks: dict[str, _Track] = {}
        self.sessions: set[str] = set()          # streaming-input sessions: turns end, they go on
        self.next_tid = 1
        self.steps = 0
        self.divs: dict[int | None, list[Divergence]] = defaultdict(list)
        for d in divergences or ():
            self.divs[d.step].append(d)
        self.tids: dict[str, int] = {}           # every request seen: divergences may name finished ones
        self.loaded: set[str] = set()            # async loads reported finished, until the next step
        self.counts: dict[str, int] = defaultdict(int)

    # -- writing -------------------------------------------------------------------

    def emit(self, obj: dict) -> None:
        self.out.write(b"\n" if self.first else b",\n")
        self.first = False
        self.out.write(orjson.dumps(obj, default=str))
        self.counts[obj["ph"]] += 1

    def begin(self) -> None:
        self.out.write(b'{"displayTimeUnit":"ms","traceEvents":[')
        h = self.header
        for pid, name, order in ((REQUESTS_PID, "requests", 1), (SCHEDULER_PID, "scheduler", 0)):
            self.emit({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": name + STEP_NOTE}})
            self.emit({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": order}})
        self.emit({"ph": "M", "name": "thread_name", "pid": SCHEDULER_PID, "tid": 0,
                   "args": {"name": f"{h.engine} {h.engine_version}"}})

    def finish(self, reader: TraceReader) -> None:
        t = self.steps * US_PER_STEP
        for req in list(self.tracks):
            self._close(req, t, "end of trace")
        # Divergences at steps beyond the trace, or at no step.
        for step in sorted(self.divs, key=lambda s: (s is None, s or 0)):
            self._divergences(step, self.divs[step])
        self.divs.clear()
        meta = {"trace": path_text(reader.path), "engine": self.header.engine,
                "engine_version": self.header.engine_version, "steps": self.steps,
                "time_unit": "1 ms = 1 scheduler step", "time_axis": TIME_AXIS}
        if reader.truncation:
            meta["truncation"] = reader.truncation
        meta.update(self.checked)
        self.out.write(b'\n],"metadata":' + orjson.dumps(meta, default=str) + b"}\n")

    # -- slices --------------------------------------------------------------------

    def _slice(self, tr: _Track, name: str, start: int, end: int, args: dict | None = None,
               cat: str = "request") -> None:
        start = max(start, tr.cursor)
        if end <= start:
            return
        e = {"ph": "X", "name": name, "cat": cat, "pid": REQUESTS_PID, "tid": tr.tid,
             "ts": start, "dur": end - start}
        if args:
            e["args"] = args
        self.emit(e)
        tr.cursor = end

    def _instant(self, tid: int, pid: int, ts: int, name: str, args: dict | None = None,
                 cat: str = "event", scope: str = "t") -> None:
        e = {"ph": "i", "s": scope, "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts}
        if args:
            e["args"] = args
        self.emit(e)

    def _end_phase(self, tr: _Track, t: int) -> None:
        if tr.phase is not None:
            self._slice(tr, tr.phase, tr.phase_start, t, tr.phase_args or None, cat=tr.phase)
            tr.phase = None
            tr.phase_args = {}

    def _end_decode(self, tr: _Track) -> None:
        if tr.decode_start is not None:
            n = (tr.decode_end - tr.decode_start) // US_PER_STEP
            self._slice(tr, "decode", tr.decode_start, tr.decode_end,
                        {"steps": n, "tokens": tr.decode_tokens}, cat="decode")
            tr.decode_start = None
            tr.decode_tokens = 0

    def _start_phase(self, tr: _Track, name: str, t: int, args: dict | None = None) -> None:
        self._end_decode(tr)
        self._end_phase(tr, t)
        tr.phase, tr.phase_start, tr.phase_args = name, t, dict(args or {})

    def _close(self, req: str, t: int, why: str) -> None:
        tr = self.tracks.pop(req, None)
        self.sessions.discard(req)
        if tr is None:
            return
        self._end_decode(tr)
        self._end_phase(tr, t)
        self._instant(tr.tid, REQUESTS_PID, max(t, tr.cursor), f"finished: {why}", cat="finish")

    # -- records -------------------------------------------------------------------

    def feed(self, e) -> None:
        if isinstance(e, ev.Step):
            self._step(e)
        elif isinstance(e, ev.Output):
            self._output(e)
        elif isinstance(e, ev.Arrival):
            self._arrival(e)
        elif isinstance(e, ev.Abort):
            for req in e.reqs:
                self._close(req, self.steps * US_PER_STEP, e.reason)

    def _arrival(self, e: ev.Arrival) -> None:
        if e.req in self.tracks:   # a streaming-input session's next chunk, or its end of input
            self._instant(self.tracks[e.req].tid, REQUESTS_PID, self.steps * US_PER_STEP, "input",
                          {"prompt_tokens": len(e.prompt_token_ids), "end": not e.resumable},
                          cat="arrival")
            return
        if e.resumable:
            self.sessions.add(e.req)
        tid = self.next_tid
        self.next_tid += 1
        self.tids[e.req] = tid
        t = self.steps * US_PER_STEP
        self.tracks[e.req] = _Track(tid, len(e.prompt_token_ids), t)
        self.emit({"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": tid,
                   "args": {"name": e.req}})
        self.emit({"ph": "M", "name": "thread_sort_index", "pid": REQUESTS_PID, "tid": tid,
                   "args": {"sort_index": tid}})
        self._instant(tid, REQUESTS_PID, t, "arrival", {
            "prompt_tokens": len(e.prompt_token_ids), "max_tokens": e.max_tokens,
            "priority": e.priority, "arrival_time": e.arrival_time}, cat="arrival")

    def _step(self, e: ev.Step) -> None:
        k = e.step
        self.steps = k + 1
        t0, t1 = k * US_PER_STEP, (k + 1) * US_PER_STEP
        for req in self.loaded:   # this schedule() takes them out of WAITING_FOR_REMOTE_KVS
            tr = self.tracks.get(req)
            if tr is not None and tr.phase == "loading KV":
                self._start_phase(tr, "waiting", t0, {"after": "load finished"})
        self.loaded.clear()
        states = {st.req: st for st in e.states}
        for req in e.preempted:
            tr = self.tracks.get(req)
            if tr is not None:
                self._start_phase(tr, "preempted", t0)
        scheduled = {it.req for it in e.new} | {it.req for it in e.resumed} | {it.req for it in e.running}
        for lk in e.lookups:
            tr = self.tracks.get(lk.req)
            if tr is None or lk.req in scheduled:
                continue
            st = states.get(lk.req)
            loading = st.status == "WAITING_FOR_REMOTE_KVS" if st is not None else bool(
                lk.load_async and lk.ext)
            if loading and tr.phase != "loading KV":
                self._start_phase(tr, "loading KV", t0, {"local": lk.local, "external": lk.ext})
        for req, st in states.items():
            tr = self.tracks.get(req)
            if tr is None or req in scheduled:
                continue
            want = _WAITING_PHASES.get(st.status)
            if want is not None and tr.phase != want and not (
                    want == "waiting" and tr.phase == "preempted"):
                self._start_phase(tr, want, t0)
        loads = defaultdict(list)
        for ld in e.loads or ():
            loads[ld.req].append([ld.start, ld.end])
        tokens = 0
        for how, items in (("new", e.new), ("resumed", e.resumed), ("running", e.running)):
            for it in items:
                tokens += it.num_scheduled_tokens
                tr = self.tracks.get(it.req)
                if tr is None:
                    continue
                st = states.get(it.req)
                if st is not None:
                    tr.num_tokens = st.num_tokens
                pre, n = it.num_computed_tokens, it.num_scheduled_tokens
                if how != "running":
                    self._end_phase(tr, t0)
                if it.req in loads:
                    self._instant(tr.tid, REQUESTS_PID, t0, "load KV",
                                  {"tokens": loads.pop(it.req)}, cat="load")
                if phase_of(pre, n, tr.prompt_len, tr.num_tokens) == "prefill":
                    self._end_decode(tr)
                    tr.chunks += 1
                    self._slice(tr, "prefill", t0, t1, {
                        "chunk": tr.chunks, "how": how, "num_computed_tokens": pre,
                        "num_scheduled_tokens": n}, cat="prefill")
                else:
                    if tr.decode_start is not None and tr.decode_end == t0:
                        tr.decode_end = t1
                    else:
                        self._end_decode(tr)
                        tr.decode_start, tr.decode_end = t0, t1
                    tr.decode_tokens += n
        for req, ranges in loads.items():    # loads for requests not scheduled this step
            tr = self.tracks.get(req)
            if tr is not None:
                self._instant(tr.tid, REQUESTS_PID, t0, "load KV", {"tokens": ranges}, cat="load")
        if e.num_free_blocks is not None:
            self.emit({"ph": "C", "name": "free blocks", "pid": SCHEDULER_PID, "tid": 0, "ts": t0,
                       "args": {"free": e.num_free_blocks}})
            self.emit({"ph": "C", "name": "KV blocks used", "pid": SCHEDULER_PID, "tid": 0, "ts": t0,
                       "args": {"used": self.usable - e.num_free_blocks}})
        self.emit({"ph": "C", "name": "scheduled tokens", "pid": SCHEDULER_PID, "tid": 0, "ts": t0,
                   "args": {"tokens": tokens}})
        self.emit({"ph": "C", "name": "running requests", "pid": SCHEDULER_PID, "tid": 0, "ts": t0,
                   "args": {"running": len(e.new) + len(e.resumed) + len(e.running)}})
        for req in e.finished:
            self._close(req, t0, "freed")
        if k in self.divs:
            self._divergences(k, self.divs.pop(k))

    def _output(self, e: ev.Output) -> None:
        t = (e.step + 1) * US_PER_STEP
        for st in e.states:
            tr = self.tracks.get(st.req)
            if tr is not None:
                tr.num_tokens = st.num_tokens
        c = e.connector
        if c is not None:
            for req in c.failed_recving:
                tr = self.tracks.get(req)
                if tr is not None:
                    self._instant(tr.tid, REQUESTS_PID, max(t - 1, tr.cursor), "load failed",
                                  cat="load")
                    if tr.phase == "loading KV":
                        self._start_phase(tr, "waiting", t, {"after": "failed load"})
            self.loaded.update(req for req in c.finished_recving if req not in c.failed_recving)
        for req, reason in e.finished.items():
            if req in self.sessions:   # a turn ends; the session waits for more input
                continue
            self._close(req, t, reason)
        for st in e.states:
            if st.status.startswith("FINISHED") and st.req in self.tracks:
                self._close(st.req, t, st.status[len("FINISHED_"):].lower())

    def _divergences(self, step: int | None, divs: list[Divergence]) -> None:
        ts = (step if step is not None else 0) * US_PER_STEP + US_PER_STEP // 2
        for d in divs:
            args = {"field": d.field, "recorded": d.recorded, "expected": d.expected,
                    "rule": d.rule, "kind": d.kind, "step": d.step, "request": d.req}
            if d.line is not None:
                args["line"] = d.line
            name = f"divergence: {d.field}"
            tid = self.tids.get(d.req) if d.req is not None else None
            if tid is not None:
                self._instant(tid, REQUESTS_PID, ts, name, args, cat="divergence")
            else:
                self._instant(0, SCHEDULER_PID, ts, name, args, cat="divergence", scope="p")


def export_perfetto(trace: str | os.PathLike, out_json: str | os.PathLike,
                    divergences: Iterable[Divergence] | None = None,
                    checked: dict | None = None) -> dict[str, int]:
    """Write ``trace`` as Chrome trace-event JSON to ``out_json``.

    ``divergences`` (from ``replay_file`` or ``diff_files``) become instant
    events at their step; none are computed here. ``checked``: what the
    replay that found them checked (``steps_checked``, ``steps_in_trace``,
    ``stopped_at``), written into the metadata. Returns how many events of
    each phase were written (``{"X": ..., "C": ..., "i": ..., "M": ...}``).
    Raises ``TraceError`` for unusable input; ``out_json`` is then left as it
    was (kvtrace/writing.py).
    """
    reader = TraceReader(trace)
    with reader, writing(out_json) as dest, dest.open("wb") as out:
        x = _Exporter(out, reader.header, divergences, checked)
        x.begin()
        for e in reader:
            x.feed(e)
        x.finish(reader)
    return dict(x.counts)


def load_events(path: str | os.PathLike) -> list[dict[str, object]]:
    """The ``traceEvents`` of an exported file (for tests and scripts)."""
    with open(path, "rb") as f:
        return orjson.loads(f.read())["traceEvents"]
