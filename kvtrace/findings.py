"""What replay and diff report: one ``Divergence`` per place where two accounts of
a run disagree. Reporters consume these; they never re-read traces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvtrace._text import count, number, plural


# What a divergence is about (docs/reference/checks.md, "Divergence kinds");
# "diff": one trace against another (kvtrace diff).
DivergenceKind = Literal["counter", "block", "lookup", "stats", "invariant", "kv-content",
                         "kv-data", "diff"]


@dataclass(slots=True)
class Divergence:
    step: int | None          # schedule() index where it shows; None for non-step records
    req: str | None           # request id, None for step-wide fields (e.g. num_free_blocks)
    field: str                # e.g. "num_computed_tokens", "block_ids", "kv-content"
    recorded: Any             # what the trace says
    expected: Any             # what the reference (or the other trace) says
    rule: str                 # the rule broken, e.g. "S:1369 admission sets c = L + E" or "I3"
    kind: DivergenceKind = "counter"
    seq: int | None = None    # sequence number of the record that shows it
    line: int | None = None   # line of the record in the recorded trace, when known
    # How the expected value comes about, in words and numbers, where replay can
    # say it: "37 = local prefix hit 32 + external hit 5 (lookup at step 44)".
    why: str | None = None
    # A diff's divergence: where it shows in trace B, (step, line). ``step``
    # and ``line`` are then trace A's.
    in_b: tuple[int | None, int | None] | None = None

    def to_json(self) -> dict:
        doc = {k: getattr(self, k) for k in _JSON_FIELDS}
        if self.kind == "diff":   # where it shows in B; null where B has no such record
            doc["step_b"], doc["line_b"] = self.in_b or (None, None)
        return doc


_JSON_FIELDS = ("step", "req", "field", "recorded", "expected", "rule", "kind", "seq", "line")


@dataclass(frozen=True, slots=True)
class Stop:
    """Where replay stopped before the end of the trace, and why. The reader
    reads on to the end, so the steps after it are counted, not checked."""

    step: int
    line: int | None
    reason: str

    def words(self, checked: int, in_trace: int) -> str:
        """The stop as every view says it: "replay stopped at step N (line
        L): why; K steps not checked" (``checked`` and ``in_trace``: the
        steps replayed, and the steps the trace holds)."""
        left = max(0, in_trace - checked)
        at = f"step {self.step}" + (f" (line {self.line})" if self.line is not None else "")
        return f"replay stopped at {at}: {self.reason}; {count(left, 'step')} not checked"

    def to_json(self) -> dict:
        return {"step": self.step, "line": self.line, "reason": self.reason}


def first_per_request(divs: list[Divergence]) -> list[Divergence]:
    """Order: each request's first divergence (by step), then everything else in trace order."""
    seen: set = set()
    first, rest = [], []
    for d in divs:
        key = d.req
        (rest if key in seen else first).append(d)
        seen.add(key)
    return first + rest


# --------------------------------------------------------------------------- causes
#
# A wrong count makes later decisions wrong: a stale num_computed_tokens changes
# the chunk the step schedules, which changes the budget left for the requests
# behind it, which changes the blocks they get. The first row of a replay is
# often such a consequence. Within a step, state a decision is made from comes
# before the decision, and the decision before what it frees or fills.

_RANK_OF_FIELD = {
    # the state a step starts from, and what the connector answered
    "num_computed_tokens": 0, "local_hit": 0, "lookup": 0, "assertion": 0,
    # what the step decided
    "queue": 1, "scheduled": 2, "num_scheduled_tokens": 2, "preempted": 2, "spec": 2,
    # what the decision allocated or freed
    "block_ids": 3, "new_block_ids": 3, "more_groups": 3,
    # the state the step left (its record's states, or its output's)
    "state.num_computed_tokens": 4, "status": 4, "num_tokens": 4, "num_preemptions": 4,
    "state.block_ids": 4, "state.more_groups": 4, "num_free_blocks": 4,
    # what the step's output shows
    "finished_req_ids": 5, "finish_reason": 5,
}
_WINDOW_RULE = "4.9:"   # the KV-cache groups' tables: what a sliding window gave back
_RANK_OF_KIND = {"invariant": 0, "lookup": 0, "counter": 1, "block": 3, "kv-data": 5,
                 "kv-content": 6, "stats": 7, "diff": 2}


def cause_rank(d: Divergence) -> int:
    """Where ``d`` sits in a step's chain of cause and effect: lower is earlier."""
    rank = _RANK_OF_FIELD.get(d.field)
    if rank is None and d.field.startswith("legacy."):
        rank = 0   # a legacy counter is written at the lookup
    if rank is None:
        rank = _RANK_OF_KIND.get(d.kind, 5)
    if d.rule.startswith(_WINDOW_RULE):
        rank = min(rank, 2)   # a sliding window gives blocks back before the step allocates
    return rank


def reached_steps(divs: list[Divergence]) -> dict[int, int]:
    """The step the trace had reached at each divergence's record (keyed by
    ``id``): its own step, or a later one an earlier record shows. Under async
    scheduling the output of step N comes after step N + 1 is scheduled
    (AS:59-77), and the states it carries are the ones step N + 1 left: what
    diverges there follows from step N + 1's decisions, not the other way."""
    out: dict[int, int] = {}
    top = None
    for d in sorted((d for d in divs if d.step is not None and d.seq is not None),
                    key=lambda d: d.seq):
        top = d.step if top is None else max(top, d.step)
        out[id(d)] = top
    return out


def causal_key(d: Divergence, reached: dict[int, int] | None = None) -> tuple:
    """Sort key: step (the step the trace had reached, with ``reached``),
    then cause before effect, then trace order."""
    step = d.step if reached is None else reached.get(id(d), d.step)
    return (float("inf") if step is None else step, cause_rank(d),
            float("inf") if d.seq is None else d.seq)


@dataclass(slots=True)
class Fold:
    """Divergences of one request under one field and rule, folded into a line."""

    first: Divergence
    count: int
    first_step: int | None
    last_step: int | None


@dataclass(slots=True)
class RequestFindings:
    """One request's divergences: its likely cause first, the rest folded.

    ``after`` is the cause of another request's findings these likely follow from: a
    request whose first divergence is a decision (what was scheduled, which
    blocks it got) in a step where another request's state was already wrong."""

    req: str | None
    cause: Divergence
    folds: list[Fold]
    count: int
    after: Divergence | None = None


def by_request(divs: list[Divergence]) -> list[RequestFindings]:
    """The divergences of a run, one RequestFindings per request, the one with
    the earliest cause first. Step-wide divergences (``req`` None) form one."""
    reached = reached_steps(divs)

    def order(d: Divergence) -> tuple:
        return causal_key(d, reached)

    by_req: dict[str | None, list[Divergence]] = {}
    for d in divs:
        by_req.setdefault(d.req, []).append(d)
    per_request = []
    for req, mine in by_req.items():
        mine.sort(key=order)
        cause = mine[0]
        folds: dict[tuple, Fold] = {}
        for d in mine[1:]:
            key = (d.field, d.rule)
            f = folds.get(key)
            if f is None:
                folds[key] = Fold(d, 1, d.step, d.step)
                continue
            f.count += 1
            if d.step is not None:
                f.first_step = d.step if f.first_step is None else min(f.first_step, d.step)
                f.last_step = d.step if f.last_step is None else max(f.last_step, d.step)
        per_request.append(RequestFindings(req, cause, list(folds.values()), len(mine)))
    per_request.sort(key=lambda s: order(s.cause))
    roots: list[Divergence] = []
    for s in per_request:
        if cause_rank(s.cause) > 0 or s.req is None:
            at = reached.get(id(s.cause), s.cause.step)
            s.after = next((r for r in roots if r.step is not None and at is not None
                            and reached.get(id(r), r.step) <= at), None)
        if s.req is not None and (cause_rank(s.cause) == 0 or s.cause.rule.startswith(_WINDOW_RULE)):
            roots.append(s.cause)   # a wrong count, or blocks a window gave back: a cause
    return per_request


def narrowed(per_request: list[RequestFindings], kept: list[Divergence]
             ) -> list[RequestFindings]:
    """The findings of each request in ``kept``, a part of the divergences
    ``per_request`` holds: each keeps the link to the request it follows from,
    shown or not."""
    after = {s.req: s.after for s in per_request}
    part = by_request(kept)
    for s in part:
        s.after = s.after or after.get(s.req)
    return part


def headline(per_request: list[RequestFindings]) -> Divergence | None:
    """The divergence a person should read first: the earliest cause that no
    other request's cause explains."""
    for s in per_request:
        if s.after is None:
            return s.cause
    return per_request[0].cause if per_request else None


# What a divergence of each cause rank is, in the words ``why_first`` uses.
_RANK_WORDS = {
    0: "a count the step starts from, or the connector's answer",
    1: "a queue the step takes requests from",
    2: "a decision the step made",
    3: "blocks the step's decision allocated or freed",
    4: "state the step left",
    5: "the step's output",
    6: "what a KV slot holds",
    7: "the prompt stats",
}


@dataclass(slots=True)
class Findings:
    """A run's divergences as every view tells them (the terminal, several
    traces, ``--json``, the HTML report): the findings of each request, the
    divergence to read first (``headline``), and why it is the first."""

    per_request: list[RequestFindings]
    headline: Divergence | None
    why: str | None


def gather(divs: list[Divergence]) -> Findings:
    """The findings of ``divs`` per request, their headline and why it comes first:
    computed once per trace, and handed to every view."""
    per_request = by_request(divs)
    head = headline(per_request)
    return Findings(per_request, head, why_first(divs, per_request, head))


def why_first(divs: list[Divergence], per_request: list[RequestFindings],
              head: Divergence | None) -> str | None:
    """Why ``head`` is the divergence to read first, in one sentence: no
    divergence at an earlier step, first among its step's in cause-and-effect
    order, and how many requests' divergences may follow from it."""
    if head is None:
        return None
    if head.step is None:
        said = "no divergence shows at a step; this is the first record that diverges"
    else:
        reached = reached_steps(divs)
        step = reached.get(id(head), head.step)
        same = sum(1 for d in divs if reached.get(id(d), d.step) == step)
        said = f"no divergence at an earlier step than {step}"
        late = min((d.step for d in divs if d.step is not None and d.step < step), default=None)
        if late is not None:
            said += (f" (the records of step {late} that diverge come after step {step} is "
                     f"scheduled, as under async scheduling, and show the state step {step} left)")
        if same > 1:
            said += (f", and of the {number(same)} at that step it comes first in cause-and-effect "
                     f"order: {_RANK_WORDS.get(cause_rank(head), 'what it is')}")
    follow = sum(1 for s in per_request if s.after is head and s.req is not None)
    if follow:
        said += (f"; {count(follow, 'other request')} {plural(follow, 'diverges', 'diverge')} "
                 "later and may follow from it")
    return said
