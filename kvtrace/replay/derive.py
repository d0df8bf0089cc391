"""How the reference arrived at an expected value, in words and numbers.

A divergence says "recorded 40, expected 37"; a person needs to know why 37.
Each function here takes divergences and the reference's state around them,
and sets ``why`` only where the numbers add up to the expected value exactly,
or with what the reference's history holds (an earlier lookup, a failed load):
a derivation is a check too, never a guess. Its counts are thousands
separated (``n``); steps are ids, and are not.
"""

from __future__ import annotations

from kvtrace._text import count, number as n
from kvtrace.findings import Divergence
from kvtrace.reference import Request, Scheduler, SchedulerOutput
from kvtrace.reference.interface import ScheduledRequest


def annotate_step(divs: list[Divergence], out: SchedulerOutput, prev: SchedulerOutput | None,
                  sched: Scheduler) -> None:
    """Set ``why`` on the divergences of a step's comparison."""
    if not divs:
        return
    mine = _scheduled(out)
    before = _scheduled(prev) if prev is not None else {}
    running = {s.req_id for s in out.running}
    for d in divs:
        if d.req is None or d.why is not None:
            continue
        s = mine.get(d.req)
        if d.field == "num_computed_tokens" and s is not None:
            d.why = (_admitted(d, sched) if d.req not in running
                     else _advanced(d, before.get(d.req), prev))
        elif d.field == "num_scheduled_tokens" and s is not None:
            d.why = _chunk(d, s, out, sched)
        elif d.field == "scheduled":
            d.why = _not_scheduled(d, out, sched)
        elif d.field == "kv_load":
            d.why = _load(d, sched)
        elif d.field == "state.num_computed_tokens" and s is not None:
            if s.num_computed_tokens + s.num_scheduled_tokens == d.expected:
                d.why = (f"{n(d.expected)} = {n(s.num_computed_tokens)} before the step + "
                         f"{n(s.num_scheduled_tokens)} scheduled")


def annotate_stats(divs: list[Divergence], r: Request) -> None:
    """Set ``why`` on the divergences of a request's legacy prompt counters:
    the lookup the expected count comes from, and a failed load that came
    before."""
    for d in divs:
        if d.why is not None or not d.field.startswith("legacy."):
            continue
        said = []
        if isinstance(d.expected, tuple):
            said += _admission_pair(d.expected, r)
        elif isinstance(d.expected, int) and d.field == "legacy.num_external_computed_tokens":
            said += _external_count(d.expected, r)
        if r.invalid_block_hits:
            said.append(f"a KV load of this request failed before (invalid blocks, "
                        f"{count(r.invalid_block_hits, 'time')})")
        if said:
            d.why = "; ".join(said)


def _external_count(expected: int, r: Request) -> list[str]:
    """An expected external count is the hit of the lookup that set it, less
    what failed loads took off."""
    at = [a for a in r.legacy_admissions if a.num_external_computed_tokens == expected]
    k = at[0].lookup if at else r.legacy_external_from
    if k is None or k >= len(r.lookup_history):
        return []
    step, _, ext, _ = r.lookup_history[k]
    if ext == expected:
        return [f"{n(expected)} = the external hit of the reference's lookup at step {step}"]
    if at or expected == r.legacy_num_external_computed_tokens:
        return [f"{n(expected)} = the external hit of the reference's lookup at step {step}, "
                f"{n(ext)}, less {count(ext - expected, 'token')} failed loads took off"]
    return []


def _admission_pair(expected: tuple, r: Request) -> list[str]:
    """An expected pair is the one admission that gives it."""
    for a in r.legacy_admissions:
        if (a.num_cached_tokens, a.num_external_computed_tokens) == expected:
            step, _, ext, _ = r.lookup_history[a.lookup]
            lost = ext - a.num_external_computed_tokens
            less = f" less {count(lost, 'token')} failed loads took off" if lost else ""
            return [f"({n(expected[0])}, {n(expected[1])}) = num_cached_tokens "
                    f"{n(a.num_cached_tokens)}, the num_computed_tokens of the admission from "
                    f"the reference's lookup at step {step}, and num_external_computed_tokens "
                    f"{n(a.num_external_computed_tokens)}, that lookup's external hit "
                    f"{n(ext)}{less}"]
    return []


def _scheduled(out: SchedulerOutput) -> dict[str, ScheduledRequest]:
    return {s.req_id: s for part in (out.running, out.resumed, out.new) for s in part}


def _admitted(d: Divergence, sched: Scheduler) -> str | None:
    """An admission sets the count to the local hit plus the external hit
    (semantics doc 1.3), one less after a full asynchronous load."""
    r = sched.requests.get(d.req)
    if r is None:
        return None
    if not r.lookup_history:
        return f"{n(d.expected)}: no prefix lookup was made" if d.expected == 0 else None
    step, local, external, load_async = r.lookup_history[-1]
    terms = f"local prefix hit {n(local)} + external hit {n(external)}"
    where = f" (the reference's lookup at step {step})"
    if local + external == d.expected:
        return f"{n(d.expected)} = {terms}{where}{_stale(d, r.lookup_history)}"
    if load_async and local + external - 1 == d.expected:
        return (f"{n(d.expected)} = {terms} - 1{where}: after a full asynchronous load "
                f"the last token is computed again{_stale(d, r.lookup_history)}")
    return None


def _stale(d: Divergence, history: list[tuple[int, int, int, bool]]) -> str:
    """Where the recorded count is what an earlier lookup found, say so: the
    engine kept a hit that has changed since."""
    if not isinstance(d.recorded, int) or d.recorded == d.expected:
        return ""
    step = history[-1][0]
    earlier = [s for s, local, ext, _ in history if s < step and local + ext == d.recorded]
    if not earlier:
        return ""
    return (f"; the recorded {n(d.recorded)} is the hit the reference's lookup at step "
            f"{earlier[-1]} found: a count kept from an earlier lookup")


def _advanced(d: Divergence, was: ScheduledRequest | None, prev: SchedulerOutput | None
              ) -> str | None:
    """A running request's count advances by what the step before scheduled,
    less the drafts it rejected."""
    if was is None or prev is None:
        return None
    c, k = was.num_computed_tokens, was.num_scheduled_tokens
    if c + k == d.expected:
        return f"{n(d.expected)} = {n(c)} computed before the last step + {n(k)} it scheduled"
    drafts = [t for t in prev.spec.get(d.req, ()) if t != -1]
    rejected = c + k - d.expected
    if drafts and 0 < rejected <= len(drafts):
        return (f"{n(d.expected)} = {n(c)} computed before the last step + {n(k)} it scheduled "
                f"- {count(rejected, 'rejected draft')}")
    return None


def _chunk(d: Divergence, s: ScheduledRequest, out: SchedulerOutput, sched: Scheduler
           ) -> str | None:
    """A chunk is the smallest of what remains, the long-prefill threshold and
    the budget the step has left (semantics doc 2.1/2.2)."""
    r = sched.requests.get(d.req)
    e = d.expected
    if r is not None and r.num_tokens - s.num_computed_tokens == e:
        return (f"{n(e)} = all that remains: {count(r.num_tokens, 'token')} - "
                f"{n(s.num_computed_tokens)} computed")
    threshold = sched.config.long_prefill_token_threshold
    if threshold and e == threshold:
        return f"{n(e)} = the long-prefill threshold"
    budget = sched.config.token_budget
    used = 0
    for other, k in out.num_scheduled_tokens.items():
        if other == d.req:
            break
        used += k
    if budget - used == e:
        return (f"{n(e)} = the token budget left: {n(budget)} - {n(used)} scheduled before it "
                "this step")
    return None


def _load(d: Divergence, sched: Scheduler) -> str | None:
    """The load an admission asks for: the tokens of the external hit, after
    the local one."""
    r = sched.requests.get(d.req)
    if r is None or not r.lookup_history or not isinstance(d.expected, list):
        return None
    step, local, external, _ = r.lookup_history[-1]
    if d.expected != [local, local + external]:
        return None
    again = (f"; admitted again after {count(r.num_preemptions, 'preemption')}"
             if r.num_preemptions else "")
    return (f"the reference's lookup at step {step} found an external hit of "
            f"{count(external, 'token')} after a local hit of {n(local)}, and the step admitted "
            f"it{again}")


def _not_scheduled(d: Divergence, out: SchedulerOutput, sched: Scheduler) -> str | None:
    """Why the reference left a request out of the step, or took it in."""
    if d.expected is not None:
        return None
    budget = sched.config.token_budget
    total = out.total_num_scheduled_tokens
    if total >= budget:
        return (f"the step's token budget was spent: {n(total)} of {count(budget, 'token')} "
                "scheduled")
    seats = sched.config.max_num_seqs
    if len(out.num_scheduled_tokens) >= seats:
        return f"max_num_seqs: {count(seats, 'request')} {'was' if seats == 1 else 'were'} scheduled"
    return None
