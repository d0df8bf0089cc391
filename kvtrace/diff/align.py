"""``diff_files``: compare two traces request by request.

Two runs of the same workload rarely number their steps alike: one engine may
take an extra empty step, or admit a request one step later. So the diff does
not compare step k with step k. It follows each request through its own
history and compares like with like:

* ``arrival``      what the request asked for (prompt, max_tokens, priority, ...);
* ``lookup``       the k-th answer the connector gave about the request (it is
                   asked every step while the request waits; a repeated answer
                   is not a new item);
* ``grammar``      a structured output's grammar: found compiled or failed
                   (not the step it was found in, which is timing);
* ``schedule``     the k-th time the request was scheduled: new, resumed or
                   running, pre-step num_computed_tokens, num_scheduled_tokens,
                   blocks, the drafts scheduled (speculative decoding), and the
                   request's state right after that schedule();
* ``output``       what update_from_output made of that k-th schedule: sampled
                   tokens, whether a grammar refused them, and the state afterwards;
* ``preempt``      each preemption, counted by how many schedules preceded it;
* ``load``         connector finished_recving / failed_recving for the request;
* ``prompt_stats`` PrefillStats or the legacy counters;
* ``finish``       finish reason, and after how many schedules.

Scheduler-wide calls (a prefix-cache reset, a pause state, a ``schedule()``
that raised) are compared k-th with k-th, as inputs are.

Each channel is a queue per side. An item is compared as soon as the other
side has its counterpart, then dropped, so memory follows the live requests
and the lag between the two files, not their length. A request's first
divergence (the earliest in trace A) is kept once both sides have finished it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..findings import Divergence
from ..results import DiffResult
from ..trace.events import (Abort, Arrival, End, Header, Output, PauseState, PromptStats, ResetPrefixCache, Step,
                            StepFailed, joined_groups, to_json)
from ..trace.io import TraceError, TraceReader, not_regular
from .handoff import diff_handoff, is_handoff_pair

CHANNELS = ("arrival", "lookup", "grammar", "schedule", "output", "preempt", "plan", "load",
            "prompt_stats", "finish")
PROGRESS_EVERY = 4096   # records read (both traces) between progress calls
# Outputs are matched to their step; forget unmatched steps older than this.
_OUTPUT_WINDOW = 8
# How many arrivals of each trace ``choose_match`` looks at.
MATCH_SAMPLE = 1000


def diff_files(path_a: str | os.PathLike, path_b: str | os.PathLike,
               match: str = "auto", progress: Callable[[int], None] | None = None,
               worker: bool | None = None) -> DiffResult:
    """Compare trace A (the one under study) with trace B (the expectation).

    ``match`` says how requests are paired: ``id`` (same request id),
    ``id-prefix`` (same id once vLLM's random ``-xxxxxxxx`` suffix is removed),
    ``arrival`` (the k-th arrival in A with the k-th in B), ``handoff`` (the
    two sides of a disaggregated deployment: ``handoff.diff_handoff``), or
    ``auto``: ``handoff`` when one trace is a KV producer's and the other a KV
    consumer's, else one picked from the first arrivals of each trace
    (``choose_match``).
    ``progress`` is called now and then with the steps read so far (the more
    of the two traces). ``worker``: whether each input's records are checked
    in a worker process of its own (``_events``); None decides by the file's
    size and the cores, as replay does.

    Raises ``TraceError`` when either file is unusable.
    """
    if match not in MATCH_MODES:
        raise ValueError(f"match must be one of {', '.join(MATCH_MODES)}")
    if match == "auto":
        for path in (path_a, path_b):
            _refuse_pipe(path)
        with TraceReader(path_a) as ra, TraceReader(path_b) as rb:
            if is_handoff_pair(ra.header, rb.header):
                match = "handoff"
    if match == "handoff":
        fields = diff_handoff(path_a, path_b, progress)
        return DiffResult(path_a=str(path_a), path_b=str(path_b), matched_by="handoff", **fields)
    return _diff(path_a, path_b, match, progress, worker)


def _diff(path_a, path_b, match: str, progress, worker) -> DiffResult:
    sampled = False
    try:
        with TraceReader(path_a) as ra, TraceReader(path_b) as rb, contextlib.ExitStack() as workers:
            if match == "auto":
                sampled = True
                match = choose_match(path_a, path_b, checked=False)
            d = _Differ(ra, rb, match, _events(ra, workers, worker), _events(rb, workers, worker))
            d.run(progress)
    except Exception:
        if sampled:
            # The first arrivals were read without the checks across records
            # (the diff reads every record checked). Where a file is broken,
            # the error is the one of reading them checked: the first input's,
            # then the second's, then the diff's.
            choose_match(path_a, path_b)
        raise
    return DiffResult(
        path_a=str(path_a), path_b=str(path_b),
        header_a=ra.header, header_b=rb.header,
        divergences=d.header_divs + [dv for _, dv in sorted(d.found, key=lambda kd: kd[0])],
        only_a=d.only["a"], only_b=d.only["b"],
        requests_compared=d.compared,
        divergent_requests=len(d.found) - len(d.only["a"]) - len(d.only["b"]),
        steps_a=d.sides["a"].steps, steps_b=d.sides["b"].steps,
        truncation_a=ra.truncation, truncation_b=rb.truncation,
        matched_by=match, end_a=ra.end, end_b=rb.end, cut_short=d.cut_short,
    )


def _refuse_pipe(path) -> None:
    """``--match auto`` reads the start of each input before the diff: an input
    that is not a regular file is refused before it is opened (a named pipe
    would wait for a writer)."""
    if not_regular(path):
        raise TraceError(Path(path), None, "not a regular file (a pipe?), which can be read only "
                                           "once, and --match auto reads the start of each trace "
                                           "before the diff: give --match id, id-prefix or arrival")


def _events(reader: TraceReader, workers: contextlib.ExitStack, worker: bool | None) -> Iterator:
    """The events of one input. With a worker, a worker process checks its
    records while this process decodes them unchecked behind it, as replay does
    (kvtrace/workers/record_worker.py): the same events, cut and errors as
    iterating the reader, with the checks, about half of a diff's work, off
    this process. By default a file large enough for replay to use a worker
    gets one (``KVTRACE_REPLAY_WORKER=0`` keeps diff in one process too)."""
    if worker is None:
        from ..workers import wanted

        worker = wanted(reader.path, content=False) >= 1
    if not worker or not reader.shareable:   # a pipe has one reader only
        return iter(reader)
    from ..workers.record_worker import RecordWorker   # a module the worker runs as __main__

    gate = RecordWorker(reader.path, reader.share())
    workers.callback(gate.close)
    return reader.checked_elsewhere(gate)


# --------------------------------------------------------------------------- histories


@dataclass(slots=True)
class _Item:
    """One thing a trace says of a request: the fields ``names`` with ``values``.
    Two items are equal when both are; the fields are made a dict only to
    report a difference."""

    step: int | None
    seq: int
    line: int
    names: tuple
    values: tuple
    # Where the item sits in its request's own history: (schedules counted when it
    # was seen, rank of its channel). Both traces number a request's history the
    # same way, so "which divergence comes first" does not depend on which trace is A.
    pos: tuple = ()

    @property
    def value(self) -> dict:
        return dict(zip(self.names, self.values))


def _item(step: int | None, seq: int, line: int, value: dict) -> _Item:
    return _Item(step, seq, line, tuple(value), tuple(value.values()))


# The order of items seen with the same schedule count: a schedule (counted as it
# is seen), its output and what rides with it, then what happens before the next
# (a lookup last: it comes just before the schedule it may admit).
_RANK = {"schedule": -1, "arrival": 0, "output": 0, "prompt_stats": 1, "finish": 1,
         "preempt": 2, "plan": 2, "load": 2, "lookup": 3, "grammar": 3}
# Under async scheduling a request can be preempted while its last schedule is
# in flight: that schedule's output, and what rides with it, comes after the
# preemption (S:1596-1606), and before the lookup that may admit it again.
_STALE_RANK = {"output": 2.3, "prompt_stats": 2.6, "finish": 2.6}
_OUTPUT_RANK, _STALE_OUTPUT = _RANK["output"], _STALE_RANK["output"]
_SCHEDULE_RANK = _RANK["schedule"]   # never stale


@dataclass(slots=True)
class _History:
    """One request as one trace tells it, minus what was already compared."""

    channels: dict[str, deque] = field(default_factory=lambda: {c: deque() for c in CHANNELS})
    n_sched: int = 0
    finished: bool = False
    done: bool = False
    arrived_after: int | None = None   # the last step before its arrival
    preempted_after: int = -1          # schedules counted at its last preemption
    last_lookup: tuple | None = None   # the answer of its last lookup since it was last scheduled


@dataclass(slots=True)
class _Pair:
    key: str
    ids: dict = field(default_factory=dict)  # side name -> that trace's request id
    a: _History | None = None
    b: _History | None = None
    compared: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CHANNELS})
    broken: set = field(default_factory=set)
    best: tuple[tuple, Divergence] | None = None

    @property
    def req(self) -> str:
        return self.ids.get("a") or self.ids.get("b")

    def offer(self, key: tuple, div: Divergence) -> None:
        if self.best is None or key < self.best[0]:
            self.best = (key, div)


# Scheduler-wide calls, compared in order per kind: the kind and its name in a rule.
_CALLS = {"reset_prefix_cache": "prefix-cache reset", "pause_state": "pause state",
          "step_failed": "schedule() that raised"}


def _call_values(ev: ResetPrefixCache | PauseState | StepFailed) -> dict:
    if isinstance(ev, PauseState):
        return {"state": ev.state}
    if isinstance(ev, StepFailed):
        return {"step": ev.step, "error": ev.error, "where": ev.where}
    return {"reset_running_requests": ev.reset_running_requests, "succeeded": ev.succeeded}


def _same_call(va: dict | None, vb: dict | None) -> bool:
    """Whether two calls of a kind agree. Two schedule() calls that raised
    agree on their step and the exception's class: its message and the line
    it was raised at are each engine's own words, and differ between releases
    and the reference."""
    if va is None or vb is None or "where" not in va:
        return va == vb
    return va["step"] == vb["step"] and va["error"].split(":", 1)[0] == vb["error"].split(":", 1)[0]


class _Side:
    def __init__(self, name: str, reader: TraceReader, events: Iterator):
        self.name = name
        self.reader = reader
        self.events = events   # the reader's events (see _events)
        self.exhausted = False
        self.steps = 0
        self.read = 0
        self.cur_step: int | None = None
        self.waiting = 0  # requests done here whose counterpart is not done yet
        self.just_finished: list[str] = []  # pair keys
        self.keys: dict[str, str] = {}  # this trace's request id -> pair key
        self.arrivals = 0
        # Live streaming-input sessions: a further arrival under one of these ids
        # is the session's next chunk (or the end of its input), not a request.
        self.sessions: set[str] = set()
        self.sched_at: dict[int, dict[str, int]] = {}
        # Scheduler-wide calls not compared yet, per kind ("reset_prefix_cache",
        # "pause_state"): (step, seq, line, values).
        self.calls: dict[str, deque] = {kind: deque() for kind in _CALLS}


class _Differ:
    def __init__(self, ra: TraceReader, rb: TraceReader, match: str,
                 events_a: Iterator, events_b: Iterator):
        self.match = match
        self.sides = {"a": _Side("a", ra, events_a), "b": _Side("b", rb, events_b)}
        self.pairs: dict[str, _Pair] = {}
        self.found: list[tuple[float, Divergence]] = []
        self.only: dict[str, list[str]] = {"a": [], "b": []}
        self.compared = 0
        self.cut_short: list[str] = []
        self.header_divs = _header_divs(ra.header, rb.header)
        self.calls_compared = dict.fromkeys(_CALLS, 0)
        self.calls_differ: set[str] = set()   # only the first differing call of a kind is reported
        # Load plans are compared only when both engines ran a connector (both record one).
        self.compare_plans = ra.header.config.connector is not None and rb.header.config.connector is not None

    # -- driving ---------------------------------------------------------------

    def run(self, progress: Callable[[int], None] | None = None) -> None:
        a, b = self.sides["a"], self.sides["b"]
        n = 0
        while not (a.exhausted and b.exhausted):
            n += 1
            if progress is not None and not n % PROGRESS_EVERY:
                progress(max(a.steps, b.steps))
            if a.exhausted:
                self._advance(b)
            elif b.exhausted:
                self._advance(a)
            elif a.waiting > b.waiting:
                self._advance(b)
            elif b.waiting > a.waiting:
                self._advance(a)
            else:
                self._advance(a if a.read <= b.read else b)
        for req in list(self.pairs):
            self._finalize(self.pairs.pop(req))
        if a.reader.truncation is None and b.reader.truncation is None:
            for kind in _CALLS:
                self._compare_calls(kind, final=True)

    def _advance(self, side: _Side) -> None:
        ev = next(side.events, None)
        if ev is None:
            side.exhausted = True
            self._promote_finished(side)
            return
        side.read += 1
        line = side.reader.last_line
        if isinstance(ev, Step):
            self._promote_finished(side)
            self._on_step(side, ev, line)
        elif isinstance(ev, Output):
            self._on_output(side, ev, line)
        elif isinstance(ev, Arrival):
            self._on_arrival(side, ev, line)
        elif isinstance(ev, Abort):
            for req in ev.reqs:
                self._finish(side, req, ev.reason, side.cur_step, ev.seq, line)
        elif isinstance(ev, PromptStats):
            v: dict[str, Any] = {}
            if ev.prefill_stats is not None:
                v.update((f"prefill_stats.{k}", x) for k, x in to_json(ev.prefill_stats).items())
            if ev.legacy is not None:
                v.update((f"legacy.{k}", x) for k, x in to_json(ev.legacy).items())
            self._add(side, ev.req, "prompt_stats", _item(ev.step, ev.seq, line, v))
        elif isinstance(ev, (ResetPrefixCache, PauseState, StepFailed)):
            step = ev.step if isinstance(ev, StepFailed) else side.cur_step
            side.calls[ev.kind].append((step, ev.seq, line, _call_values(ev)))
            self._compare_calls(ev.kind)
        elif isinstance(ev, End):
            pass

    # -- events ----------------------------------------------------------------

    def _on_arrival(self, side: _Side, ev: Arrival, line: int) -> None:
        v = to_json(ev)
        for k in ("seq", "req", "kind", "arrival_time"):
            v.pop(k, None)
        if ev.req in side.sessions:   # a session's next chunk: the same request goes on
            self._add(side, ev.req, "arrival", _item(None, ev.seq, line, v))
            return
        if ev.resumable:
            side.sessions.add(ev.req)
        key = _match_key(self.match, ev.req, side.arrivals)
        side.arrivals += 1
        side.keys[ev.req] = key
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = _Pair(key)
        h = getattr(pair, side.name)
        if h is None:
            setattr(pair, side.name, _History(arrived_after=side.cur_step))
            pair.ids[side.name] = ev.req
        elif h.finished:
            # An id used again once its request finished, while the other trace
            # still holds the first one: the two go on as one history.
            if h.done:
                side.waiting -= 1
            elif key in side.just_finished:
                side.just_finished.remove(key)
            h.finished = h.done = False
        self._add(side, ev.req, "arrival", _item(None, ev.seq, line, v))

    def _on_step(self, side: _Side, ev: Step, line: int) -> None:
        side.steps += 1
        side.cur_step = step = ev.step
        seq = ev.seq
        sched_at = side.sched_at   # by step, in the order of steps
        while sched_at:
            oldest = next(iter(sched_at))
            if oldest >= step - _OUTPUT_WINDOW:
                break
            del sched_at[oldest]
        for lk in ev.lookups:
            # A request that waits (for space, or for its async load) is looked up
            # every step; only a change in the answer is a new item, so that a
            # request admitted a step later still lines up.
            pair, h = self._pair_hist(side, lk.req)
            v = (lk.local, lk.ext, lk.load_async)
            if h is not None and v != h.last_lookup:
                h.last_lookup = v
                self._push(pair, h, "lookup", _Item(ev.step, ev.seq, line, _LOOKUP, v))
        for req, outcome in (ev.grammar or {}).items():
            self._add(side, req, "grammar", _item(ev.step, ev.seq, line, {"grammar": outcome}))
        states = {st.req: st for st in ev.states} if ev.states else {}
        for req in ev.preempted:
            h = self._hist(side, req)
            if h is not None:
                v = {"after_schedules": h.n_sched}
                st = states.get(req)
                if st is not None:   # what preemption left of the request's counters
                    v.update(zip(_STATE_KEYS["state"], _state(st)))
                self._add(side, req, "preempt", _item(ev.step, ev.seq, line, v))
                h.preempted_after = h.n_sched
        # The connector's load plan: with the schedule record of a request admitted
        # in this step, on its own channel for an async load (not scheduled yet).
        plans: dict[str, list] = {}
        if self.compare_plans and ev.loads is not None:
            for ld in ev.loads:
                plans.setdefault(ld.req, []).append([ld.start, ld.end])
        scheduled_now = {s.req for s in (*ev.new, *ev.resumed, *ev.running)} if plans else ()
        for req, spans in plans.items():
            h = self._hist(side, req)
            if h is not None and req not in scheduled_now:
                self._add(side, req, "plan", _item(ev.step, ev.seq, line, {
                    "kv_load": spans, "after_schedules": h.n_sched}))
        # The schedules, each pushed as _push does (inline: with outputs, the
        # diff's most frequent items).
        at: dict[str, int] = {}
        pairs, keys, is_a = self.pairs, side.keys, side.name == "a"
        compare_plans, spec = self.compare_plans, ev.spec
        for how, items in (("new", ev.new), ("resumed", ev.resumed), ("running", ev.running)):
            if not items:
                continue
            running = how == "running"
            plan = compare_plans and not running
            with_state, without = (_SCHEDULE[not running, plan, st] for st in (True, False))
            for s in items:
                req = s.req
                pair = pairs.get(keys.get(req))
                if pair is None:
                    continue
                h = pair.a if is_a else pair.b
                if h is None:
                    continue
                more = s.more_groups
                blocks = s.new_block_ids if running else s.block_ids
                if more and any(more):   # joined_groups
                    blocks = [blocks, *more]
                st = states.get(req)
                if plan:
                    v = (how, s.num_computed_tokens, s.num_scheduled_tokens, blocks, plans.get(req))
                    if st is not None:
                        v += _state(st)
                elif st is not None:   # _state, inline
                    more = st.more_groups
                    v = (how, s.num_computed_tokens, s.num_scheduled_tokens, blocks, st.status,
                         st.num_computed_tokens, st.num_tokens, st.num_preemptions,
                         [st.block_ids, *more] if more and any(more) else st.block_ids)
                else:
                    v = (how, s.num_computed_tokens, s.num_scheduled_tokens, blocks)
                names = without if st is None else with_state
                at[req] = h.n_sched
                h.n_sched = n = h.n_sched + 1
                h.last_lookup = None
                if spec and req in spec:   # the drafts scheduled (speculative decoding)
                    names += ("spec",)
                    v += (spec[req],)
                if not h.done:
                    self._push_values(pair, h, is_a, "schedule", step, seq, line, names, v,
                                      (n, _SCHEDULE_RANK))
        sched_at[step] = at

    def _on_output(self, side: _Side, ev: Output, line: int) -> None:
        states = {st.req: st for st in ev.states} if ev.states else {}
        rejected = ev.grammar_rejected or ()
        step, seq, sampled = ev.step, ev.seq, ev.sampled
        pairs, keys, is_a = self.pairs, side.keys, side.name == "a"
        for req in side.sched_at.pop(step, ()):
            pair = pairs.get(keys.get(req))
            if pair is None:
                continue
            h = pair.a if is_a else pair.b
            if h is None:
                continue
            st = states.get(req)
            if st is None:
                names, v = _OUTPUT[False], (sampled.get(req, []),)
            else:   # _state, inline
                more = st.more_groups
                names, v = _OUTPUT[True], (
                    sampled.get(req, []), st.status, st.num_computed_tokens, st.num_tokens,
                    st.num_preemptions, [st.block_ids, *more] if more and any(more) else st.block_ids)
            if req in rejected:   # a structured output's grammar refused the tokens
                names, v = names + ("grammar_rejected",), v + (True,)
            if not h.done:
                n = h.n_sched
                rank = _STALE_OUTPUT if h.preempted_after == n else _OUTPUT_RANK
                self._push_values(pair, h, is_a, "output", step, seq, line, names, v, (n, rank))
        if ev.connector is not None:
            for what in ("finished_recving", "failed_recving"):
                for req in getattr(ev.connector, what):
                    h = self._hist(side, req)
                    if h is not None:
                        self._add(side, req, "load", _item(
                            ev.step, ev.seq, line, {"event": what, "after_schedules": h.n_sched}))
        turns = ev.turn_ends()
        for req, reason in ev.finished.items():
            if req in turns and req in side.sessions:
                h = self._hist(side, req)   # a session's turn ends; the session goes on
                if h is not None:
                    self._add(side, req, "finish", _item(ev.step, ev.seq, line, {
                        "finish_reason": reason, "after_schedules": h.n_sched, "turn_ends": True}))
            else:
                self._finish(side, req, reason, ev.step, ev.seq, line)

    def _finish(self, side: _Side, req: str, reason: str, step, seq: int, line: int) -> None:
        side.sessions.discard(req)
        h = self._hist(side, req)
        if h is None or h.finished:
            return
        h.finished = True
        self._add(side, req, "finish",
                  _item(step, seq, line, {"finish_reason": reason, "after_schedules": h.n_sched}))
        side.just_finished.append(side.keys[req])

    def _promote_finished(self, side: _Side) -> None:
        """A finished request is done once its side reaches the next step (its
        prompt stats may follow the output that finished it), or its end."""
        reqs = list(self.pairs) if side.exhausted else side.just_finished
        side.just_finished = []
        other = self.sides["b" if side.name == "a" else "a"]
        for key in reqs:
            pair = self.pairs.get(key)
            h = None if pair is None else getattr(pair, side.name)
            if h is None or h.done:
                continue
            h.done = True
            oh = getattr(pair, other.name)
            if oh is not None and oh.done:
                other.waiting -= 1
                self._finalize(self.pairs.pop(key))
            else:
                side.waiting += 1

    # -- comparing -------------------------------------------------------------

    def _hist(self, side: _Side, req: str) -> _History | None:
        return self._pair_hist(side, req)[1]

    def _pair_hist(self, side: _Side, req: str) -> tuple[_Pair | None, _History | None]:
        pair = self.pairs.get(side.keys.get(req))
        return (None, None) if pair is None else (pair, getattr(pair, side.name))

    def _add(self, side: _Side, req: str, channel: str, item: _Item) -> None:
        pair, h = self._pair_hist(side, req)
        if h is not None:
            self._push(pair, h, channel, item)

    def _push_values(self, pair: _Pair, h: _History, is_a: bool, channel: str, step: int,
                     seq: int, line: int, names: tuple, values: tuple, pos: tuple) -> None:
        """``_push`` for a schedule or an output, the most frequent items, of a
        history not done, at ``pos``: where the other side already waits with
        the same values, the pair is compared without making the item."""
        q = h.channels[channel]
        other = pair.b if is_a else pair.a
        oq = None if other is None else other.channels[channel]
        if oq and not q and oq[0].values == values and oq[0].names == names:
            oq.popleft()   # _compare's first case
            pair.compared[channel] += 1
            return
        q.append(_Item(step, seq, line, names, values, pos))
        if oq:
            self._compare(pair, channel)

    def _push(self, pair: _Pair, h: _History, channel: str, item: _Item) -> None:
        """Add ``item`` to ``h``, the history of one side of ``pair``, and compare
        what both sides now hold on ``channel``."""
        if h.done:
            # A request's history ends at its finish, with what rides on the same
            # output (its prompt stats): what a trace says of it after its next
            # step (a transfer that completes after an abort) is not compared, so
            # that both traces end it alike however far apart they are read.
            return
        rank = _RANK[channel]
        if h.preempted_after == h.n_sched and channel in _STALE_RANK:
            rank = _STALE_RANK[channel]   # the output of a schedule made before the preemption
        item.pos = (h.n_sched, rank)
        h.channels[channel].append(item)
        other = pair.b if h is pair.a else pair.a
        if other is not None and other.channels[channel]:
            self._compare(pair, channel)

    def _compare(self, pair: _Pair, channel: str) -> None:
        qa, qb = pair.a.channels[channel], pair.b.channels[channel]
        while qa and qb:
            ia, ib = qa.popleft(), qb.popleft()
            k = pair.compared[channel]
            pair.compared[channel] = k + 1
            if (ia.values == ib.values and ia.names == ib.names) or channel in pair.broken:
                continue
            da, db = ia.value, ib.value
            if da == db:
                continue   # the same fields, found in another order
            key = min(ia.pos, ib.pos)
            if pair.best is not None and pair.best[0] < key:
                continue  # an earlier divergence is already known
            names = _common_stats(da, db) if channel == "prompt_stats" else _union(da, db)
            for name in names:
                va, vb = da.get(name), db.get(name)
                if va != vb:
                    pair.broken.add(channel)
                    pair.offer(key, Divergence(
                        step=ia.step, req=pair.req, field=name, recorded=va, expected=vb,
                        in_b=(ib.step, ib.line),
                        rule=f"diff: {_what(channel, k, pair.req)} differs", kind="diff",
                        seq=ia.seq, line=ia.line))
                    break

    def _compare_calls(self, kind: str, final: bool = False) -> None:
        """The k-th scheduler-wide call of a kind in A (a prefix-cache reset, a
        pause state) with the k-th of B: they are inputs, like arrivals, and
        change what every request can hit or when it is scheduled; at the end,
        a call only one trace has."""
        qa, qb = self.sides["a"].calls[kind], self.sides["b"].calls[kind]
        while qa and qb or final and (qa or qb):
            ia = qa.popleft() if qa else None
            ib = qb.popleft() if qb else None
            k = self.calls_compared[kind]
            self.calls_compared[kind] += 1
            va, vb = (None if i is None else i[3] for i in (ia, ib))
            if _same_call(va, vb) or kind in self.calls_differ:
                continue
            self.calls_differ.add(kind)
            at = ia if ia is not None else ib
            self.found.append((ia[1] if ia is not None else math.inf, Divergence(
                step=at[0], req=None, field=kind, recorded=va, expected=vb,
                rule=f"diff: {_ordinal(k + 1)} {_CALLS[kind]} differs", kind="diff",
                seq=ia[1] if ia is not None else None, line=ia[2] if ia is not None else None)))

    def _cut_step(self, name: str) -> int | None:
        """For a trace that was cut off, the last step it holds (-1: none);
        None for a whole trace. Whatever the other trace has at that step or
        later may lie past the cut (a step's output and prompt stats come after
        it), and is not a divergence."""
        side = self.sides[name]
        if side.reader.truncation is None:
            return None
        return -1 if side.cur_step is None else side.cur_step

    def _finalize(self, pair: _Pair) -> None:
        for name, rid in pair.ids.items():
            if self.sides[name].keys.get(rid) == pair.key:
                del self.sides[name].keys[rid]
        if pair.a is None or pair.b is None:
            side = "a" if pair.b is None else "b"
            cut = self._cut_step("b" if side == "a" else "a")
            h = pair.a if side == "a" else pair.b
            if cut is not None and _at(h.arrived_after) >= cut:
                self.cut_short.append(pair.ids[side])   # it may arrive past the cut
                return
            self.only[side].append(pair.ids[side])
            first = next((q[0] for q in h.channels.values() if q), None)
            in_a = side == "a" and first is not None
            rule = "diff: request only in A" if side == "a" else "diff: request only in B" + (
                f" ({_place_in_b(first)})" if first is not None else "")
            self.found.append((first.seq if in_a else math.inf, Divergence(
                step=first.step if in_a else None, req=pair.ids[side], field="request",
                recorded="present" if side == "a" else None,
                expected="present" if side == "b" else None,
                rule=rule, kind="diff",
                seq=first.seq if in_a else None, line=first.line if in_a else None)))
            return
        self.compared += 1
        cut_a, cut_b = self._cut_step("a"), self._cut_step("b")
        past_cut = False
        for channel in CHANNELS:
            self._compare(pair, channel)
            if channel in pair.broken:
                continue
            qa, qb = pair.a.channels[channel], pair.b.channels[channel]
            if cut_b is not None:   # what only A holds from B's cut on
                kept = [i for i in qa if _at(i.step) < cut_b]
                past_cut |= len(kept) < len(qa)
                qa = kept
            if cut_a is not None:
                kept = [i for i in qb if _at(i.step) < cut_a]
                past_cut |= len(kept) < len(qb)
                qb = kept
            k = pair.compared[channel]
            if qa:
                ia = qa[0]
                pair.offer(ia.pos, Divergence(
                    step=ia.step, req=pair.req, field=channel, recorded=ia.value, expected=None,
                    rule=f"diff: {_what(channel, k, pair.req)} only in A", kind="diff",
                    seq=ia.seq, line=ia.line))
            elif qb:   # nowhere in A: B's place is named instead
                ib = qb[0]
                pair.offer(ib.pos, Divergence(
                    step=None, req=pair.req, field=channel, recorded=None, expected=ib.value,
                    in_b=(ib.step, ib.line),
                    rule=f"diff: {_what(channel, k, pair.req)} only in B ({_place_in_b(ib)})", kind="diff",
                    seq=None, line=None))
        if pair.best is None and past_cut:
            self.cut_short.append(pair.req)
        if pair.best is not None:
            div = pair.best[1]
            self.found.append((div.seq if div.seq is not None else math.inf, div))


# --------------------------------------------------------------------------- helpers


# vLLM appends a random suffix to every request id ("0-a34120fd"), so two runs of
# one workload share no ids; the part before it is the id the caller chose.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
MATCH_MODES = ("auto", "id", "id-prefix", "arrival", "handoff")


def _match_key(mode: str, req: str, ordinal: int) -> str:
    if mode == "id-prefix":
        return _RANDOM_SUFFIX.sub("", req)
    if mode == "arrival":
        return f"#{ordinal}"
    return req


def _first_arrivals(path, n: int = MATCH_SAMPLE, records: int = 10 * MATCH_SAMPLE,
                    checked: bool = True) -> list[str]:
    """The ids of the first ``n`` arrivals, within the first ``records`` records;
    ``checked``: each record checked against those before it too (validate.py)."""
    ids: list[str] = []
    with TraceReader(path, validate=checked) as r:
        for k, ev in enumerate(r):
            if isinstance(ev, Arrival):
                ids.append(ev.req)
                if len(ids) >= n:
                    break
            if k >= records:
                break
    return ids


def choose_match(path_a, path_b, checked: bool = True) -> str:
    """How to pair requests, from the first ``MATCH_SAMPLE`` arrivals of each
    trace: by id when most of them share ids, by the id without vLLM's random
    suffix when most share that, else by order of arrival. ``checked=False``
    leaves out the checks across records, and a caller that goes on to read
    every record checked calls it again with them where that fails."""
    fa, fb = (_first_arrivals(p, checked=checked) for p in (path_a, path_b))
    if not fa or not fb:
        return "id"
    fa, fb = set(fa), set(fb)
    fewer = min(len(fa), len(fb))
    if 2 * len(fa & fb) > fewer:
        return "id"
    pa = {_RANDOM_SUFFIX.sub("", r) for r in fa}
    if 2 * len(pa & {_RANDOM_SUFFIX.sub("", r) for r in fb}) > fewer:
        return "id-prefix"
    return "arrival"


_STATE_KEYS = {prefix: tuple(f"{prefix}.{name}" for name in
                             ("status", "num_computed_tokens", "num_tokens", "num_preemptions", "block_ids"))
               for prefix in ("state", "output_state")}
_LOOKUP = ("lookup.local", "lookup.ext", "lookup.load_async")
# The fields of a schedule item, by (admitted: new or resumed, with its load plan,
# with the request's state), and of an output item, by (with the state).
_SCHEDULE = {(admitted, plan, state): ("scheduled_as", "num_computed_tokens", "num_scheduled_tokens",
                                       "block_ids" if admitted else "new_block_ids")
             + (("kv_load",) if plan else ()) + (_STATE_KEYS["state"] if state else ())
             for admitted in (False, True) for plan in (False, True) for state in (False, True)}
_OUTPUT = {False: ("sampled",), True: ("sampled",) + _STATE_KEYS["output_state"]}


def _state(st) -> tuple:
    return (st.status, st.num_computed_tokens, st.num_tokens, st.num_preemptions,
            joined_groups(st.block_ids, st.more_groups))


def _at(step: int | None) -> int:
    """A step for comparing with a cut (an arrival before any step: -1)."""
    return -1 if step is None else step


def _common_stats(a: dict, b: dict) -> list[str]:
    """Prompt stats are compared in the shapes both traces carry: an engine
    emits PrefillStats, the legacy pair or both (the header's ``counters``
    names the one it is built around), and one trace's extra shape is nothing
    the other contradicts."""
    shapes = {k.split(".")[0] for k in a} & {k.split(".")[0] for k in b}
    return [k for k in _union(a, b) if k.split(".")[0] in shapes]


def _place_in_b(item: _Item) -> str:
    return (f"B's step {item.step}, line {item.line}" if item.step is not None
            else f"B's line {item.line}")


def _union(a: dict, b: dict) -> list[str]:
    return list(a) + [k for k in b if k not in a]


def _ordinal(n: int) -> str:
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def _what(channel: str, k: int, req: str) -> str:
    nth = _ordinal(k + 1)
    return {
        "arrival": f"arrival of {req}",
        "lookup": f"{nth} lookup of {req}",
        "grammar": f"{nth} grammar outcome of {req}",
        "schedule": f"{nth} schedule of {req}",
        "output": f"output of the {nth} schedule of {req}",
        "preempt": f"{nth} preemption of {req}",
        "plan": f"{nth} planned KV load of {req}",
        "load": f"{nth} KV-load event of {req}",
        "prompt_stats": f"prompt stats of {req}",
        "finish": f"finish of {req}",
    }[channel]


def _flatten(obj: Any, prefix: str) -> dict:
    if isinstance(obj, dict):
        out: dict = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    return {prefix: obj}


# Engine features that say nothing about scheduling decisions.
_IGNORED_FEATURES = ("scheduler_cls",)


def _config(h: Header) -> dict:
    """The config as JSON, with an unset max_num_scheduled_tokens spelled out
    (it means max_num_batched_tokens)."""
    c = to_json(h.config)
    if c.get("max_num_scheduled_tokens") is None:
        c["max_num_scheduled_tokens"] = c["max_num_batched_tokens"]
    return c


def _header_divs(ha: Header, hb: Header) -> list[Divergence]:
    """The scheduler configs must agree. Engine features are compared only where
    both traces name them: recorders of different engines list different ones."""
    na, nb = ha.features.named(), hb.features.named()
    common = [k for k in na if k in nb and k not in _IGNORED_FEATURES]
    fa = _flatten(_config(ha), "config") | _flatten({k: na[k] for k in common}, "features")
    fb = _flatten(_config(hb), "config") | _flatten({k: nb[k] for k in common}, "features")
    return [Divergence(step=None, req=None, field=k, recorded=fa.get(k), expected=fb.get(k),
                       rule="diff: the two runs were configured differently", kind="diff")
            for k in _union(fa, fb) if fa.get(k) != fb.get(k)]
