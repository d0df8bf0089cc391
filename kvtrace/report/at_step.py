"""One step of a run as the trace tells it: ``read_step(path, n)``.

Reads the trace up to the record of step ``n`` and stops there. The batch is
that record's. The queues and the block tables are derived from the records
up to it:

* each request's place comes from its last recorded state (the ``states`` of
  step and output records), else from what happened to it last: its arrival
  (waiting), its scheduling (running), its preemption, an asynchronous lookup
  (waiting for remote KV); a finish, an abort or a ``finished`` entry ends it.
  A request the step's own ``states`` list is placed exactly; another by its
  last news (``Placed.news``).
* a request the step looked up (its record's ``lookups``) but did not
  schedule keeps that lookup (``Placed.lookup``): an admission that failed,
  or an asynchronous load it now waits for.
* a request's block table is the whole table of its last admission (``new``
  or ``resumed``) plus the new blocks of each step it ran in since; a
  preemption or a finish empties it. A request that is not running holds the
  blocks of its last recorded state: none, or while it waits for remote KV
  those its load writes (the scheduler output does not carry them).
  Blocks a sliding window lets go are not in the scheduler output: the
  step's own recorded state shows them as the null block 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._text import count
from ..trace import events as ev
from ..trace.io import TraceReader

WAITING = ("WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_STREAMING_REQ")
QUEUES = ("waiting", "waiting for remote KV", "preempted", "running, not scheduled")


class StepNotFound(LookupError):
    """The trace has no such step. ``str()`` is the one-line message."""

    exit_code = 2


class UnknownRequest(LookupError):
    """The request id is not in the trace. ``str()`` is the one-line message."""

    exit_code = 2


def one_request(request: str, ids: list[str], path: str | os.PathLike, where: str,
                total: int) -> str:
    """The one id of ``ids`` that ``request`` names: itself, or the only id it
    begins (vLLM ids end in a random suffix). Else ``UnknownRequest``, saying
    ``where`` was looked ("in the trace") and among how many (``total``)."""
    if request in ids:
        return request
    matches = [r for r in ids if r.startswith(request)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UnknownRequest(f"{path}: no request {request!r} {where} ({count(total, 'request')})")
    shown = ", ".join(matches[:8]) + (" …" if len(matches) > 8 else "")
    raise UnknownRequest(f"{path}: {count(len(matches), 'request')} start with {request!r}: "
                         f"{shown}")


@dataclass
class Scheduled:
    """A request in the step's batch, as the step record gives it."""

    req: str
    how: str                  # "new", "resumed" or "running"
    computed: int             # num_computed_tokens before the step
    scheduled: int            # num_scheduled_tokens
    blocks: list[list[int]]   # per KV-cache group: the whole table (new, resumed) or the new blocks
    drafts: int = 0           # draft tokens scheduled (speculative decoding)


@dataclass
class Placed:
    """A live request that the step did not schedule, and where it is."""

    req: str
    queue: str        # one of QUEUES
    status: str       # its status as last recorded or derived
    news: str         # the last news of it that placed it ("arrived @12": before step 12)
    exact: bool       # placed by the step's own recorded state
    # Its lookup in this step (the last, if several): the scheduler looked it up
    # for admission and did not schedule it. None: not looked up in this step.
    lookup: ev.Lookup | None = None


@dataclass
class StepView:
    path: str
    header: ev.Header
    step: int
    line: int                                   # the step record's line
    record: ev.Step
    batch: list[Scheduled]
    queued: list[Placed]
    tables: dict[str, list[list[int]]]          # live request -> table per group
    from_state: set[str]                        # tables taken from a recorded state
    states: dict[str, ev.RequestState]          # the step's own recorded states
    arrived: list[str]                          # every request arrived by the step, in order
    groups: int                                 # KV-cache groups
    request: str | None = None                  # the one request asked for, resolved
    # A step whose schedule() raised (a step_failed record): the exception and
    # where it was raised; the record holds what the step asked until then.
    failed: str | None = None

    def table_of(self, req: str) -> list[list[int]]:
        return self.tables.get(req, [[] for _ in range(self.groups)])


def read_step(path: str | os.PathLike, n: int, request: str | None = None) -> StepView:
    """The view of step ``n``. Raises ``StepNotFound`` when the trace ends
    before it, ``TraceError`` for an unusable trace, and ``UnknownRequest``
    when ``request`` (an id, or the prefix of exactly one) names no request
    that arrived by step ``n``, or several."""
    with TraceReader(path) as r:
        h = r.header
        groups = max(1, len(h.features.kv_cache_groups or ()) or (h.features.num_kv_cache_groups or 1))
        t = _Tracker(groups)
        last = -1
        for e in r:
            kind = type(e)
            if (kind is ev.Step or kind is ev.StepFailed) and e.step == n:
                view = t.view(path, h, e if kind is ev.Step else _as_step(e), r.last_line)
                if kind is ev.StepFailed:
                    view.failed = e.error + (f" at {e.where}" if e.where else "")
                if request is not None:
                    view.request = one_request(request, view.arrived, path,
                                               f"arrived by step {n}", len(view.arrived))
                return view
            if kind is ev.Step:
                last = e.step
                t.step(e)
                t.before_step = e.step + 1
            elif kind is ev.Output:
                t.output(e)
            elif kind is ev.Arrival:
                t.arrival(e)
            elif kind is ev.Abort:
                t.gone(e.reqs)
        cut = f" ({r.truncation})" if r.truncation else ""
    if last < 0:
        raise StepNotFound(f"{path}: no step {n}: the trace holds no step{cut}")
    raise StepNotFound(f"{path}: no step {n}: the last step is {last}{cut}")


def _as_step(f: ev.StepFailed) -> ev.Step:
    """A failed step as the step record it never got: what it asked, nothing
    scheduled."""
    return ev.Step(seq=f.seq, step=f.step, lookups=f.lookups, loads=f.loads, grammar=f.grammar,
                   throttle_prefills=f.throttle_prefills)


class _Tracker:
    """Each live request's place and block table, record by record."""

    def __init__(self, groups: int):
        self.groups = groups
        self.status: dict[str, str] = {}
        self.news: dict[str, str] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.from_state: set[str] = set()
        self.arrived: list[str] = []
        self.before_step = 0   # the step the next arrival comes before

    def _set(self, req: str, status: str, news: str) -> None:
        if status.startswith("FINISHED_"):
            self.gone([req])
            return
        if req in self.status:
            self.status[req] = status
            self.news[req] = news

    def gone(self, reqs) -> None:
        for req in reqs:
            self.status.pop(req, None)
            self.news.pop(req, None)
            self.tables.pop(req, None)
            self.from_state.discard(req)

    def arrival(self, a: ev.Arrival) -> None:
        if a.req in self.status:   # a further chunk of a live streaming session
            return
        self.arrived.append(a.req)
        self.status[a.req] = ("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR" if a.structured_output
                              else "WAITING")
        self.news[a.req] = f"arrived @{self.before_step}"

    def _groups_of(self, ids: list[int], more) -> list[list[int]]:
        out = [list(ids)] + [list(g) for g in (more or ())]
        return out + [[] for _ in range(self.groups - len(out))]

    def step(self, s: ev.Step) -> None:
        k = s.step
        for req in s.preempted:
            self._set(req, "PREEMPTED", f"preempted @{k}")
            self.tables.pop(req, None)
        self.gone(s.finished)
        for lk in s.lookups:
            if lk.load_async and lk.ext:
                self._set(lk.req, "WAITING_FOR_REMOTE_KVS", f"async lookup @{k}")
        for item in (*s.new, *s.resumed):
            self._set(item.req, "RUNNING", f"scheduled @{k}")
            if item.req in self.status:
                self.tables[item.req] = self._groups_of(item.block_ids, item.more_groups)
                self.from_state.discard(item.req)
        for item in s.running:
            self._set(item.req, "RUNNING", f"scheduled @{k}")
            if item.req in self.status:
                new = self._groups_of(item.new_block_ids, item.more_groups)
                table = self.tables.setdefault(item.req, [])
                table += [[] for _ in range(len(new) - len(table))]
                for g, ids in enumerate(new):
                    table[g].extend(ids)
        self._states(s.states, f"state @{k}")

    def output(self, o: ev.Output) -> None:
        ends = o.turn_ends()
        self.gone(r for r in o.finished if r not in ends)
        self._states(o.states, f"output @{o.step}")

    def _states(self, states, news: str) -> None:
        for st in states:
            self._set(st.req, st.status, news)
            if st.status != "RUNNING" and st.req in self.status:
                table = self._groups_of(st.block_ids, st.more_groups)
                if any(table):   # blocks held while waiting: an asynchronous load's
                    self.tables[st.req] = table
                    self.from_state.add(st.req)
                else:
                    self.tables.pop(st.req, None)
                    self.from_state.discard(st.req)

    def view(self, path, h: ev.Header, s: ev.Step, line: int) -> StepView:
        spec = s.spec or {}
        batch = [Scheduled(i.req, how, i.num_computed_tokens, i.num_scheduled_tokens,
                           self._groups_of(i.block_ids, i.more_groups),
                           sum(1 for d in spec.get(i.req, ()) if d >= 0))
                 for how, items in (("new", s.new), ("resumed", s.resumed)) for i in items]
        batch += [Scheduled(i.req, "running", i.num_computed_tokens, i.num_scheduled_tokens,
                            self._groups_of(i.new_block_ids, i.more_groups),
                            sum(1 for d in spec.get(i.req, ()) if d >= 0)) for i in s.running]
        self.step(s)
        own = {st.req: st for st in s.states}
        in_batch = {b.req for b in batch}
        looked_up = {lk.req: lk for lk in s.lookups}
        queued = []
        for req in self.arrived:
            status = self.status.get(req)
            if status is None or req in in_batch:
                continue
            queue = ("waiting" if status in WAITING else
                     "waiting for remote KV" if status == "WAITING_FOR_REMOTE_KVS" else
                     "preempted" if status == "PREEMPTED" else "running, not scheduled")
            queued.append(Placed(req, queue, status, self.news[req], req in own,
                                 looked_up.get(req)))
        live = set(self.status)
        groups = max([self.groups, *(len(t) for t in self.tables.values()),
                      *(len(b.blocks) for b in batch)])
        return StepView(path=str(path), header=h, step=s.step, line=line, record=s, batch=batch,
                        queued=queued, tables={r: t for r, t in self.tables.items() if r in live},
                        from_state=set(self.from_state), states=own,
                        arrived=list(self.arrived), groups=groups)



