"""A step whose ``schedule()`` raised in the engine (a ``step_failed``
record): the reference runs the same step, with the connector's answers and
grammars the engine's step had, and says whether it fails there too.

The engine's failure is always a finding. Where the reference fails one of
the engine's assertions, the divergence names the request, the rule, and the
counts that broke it; where it schedules the step, the divergence says that
the engine failed where the reference did not (rule ``crash``).
"""

from __future__ import annotations

from kvtrace.findings import Divergence
from kvtrace.reference import Scheduler, SchedulerAssertion
from kvtrace.trace import events as ev

from .connector import RecordedConnector

CRASH_RULE = ("crash: the engine's schedule() fails only where the reference fails "
              "(it scheduled this step with the engine's inputs)")


def run_failed_step(sched: Scheduler, connector: RecordedConnector, e: ev.StepFailed,
                    line: int | None) -> tuple[list[Divergence], SchedulerAssertion | None]:
    """Run step ``e.step`` on ``sched`` with ``e``'s inputs. The divergences
    it shows (the failure first, then the lookups that do not line up), and
    the reference's own failure there, if it failed."""
    connector.start_step(e.step, e.lookups)
    if e.grammar:
        sched.grammar_compiled(e.grammar)
    failed = None
    try:
        sched.schedule(e.throttle_prefills)
    except SchedulerAssertion as a:
        failed = a
    connector.end_step()
    engine = f"schedule() raised {e.error}" + (f" at {e.where}" if e.where else "")
    if failed is None:
        first = Divergence(e.step, None, "schedule", engine, "no failure: the step is scheduled",
                           CRASH_RULE, "invariant", e.seq, line)
    else:
        first = Divergence(e.step, failed.req_id, "assertion", engine, "engine assertion",
                           failed.rule, "invariant", e.seq, line)
        first.why = counts(sched, connector, failed)
    found = [first, *connector.divergences]
    connector.divergences = []
    for d in found:
        d.seq, d.line = e.seq, line
    return found, failed


def failed_record(seq: int, e: ev.StepFailed, failed: SchedulerAssertion,
                  connector: RecordedConnector) -> ev.StepFailed:
    """The reference's own failure of step ``e.step``, as a ``step_failed``
    record of what it decided: the exception class the engine raises there,
    the rule as its message and where, and the lookups it made."""
    return ev.StepFailed(seq, e.step, f"{failed.engine_error}: {failed.rule}",
                         where=f"reference {failed.rule.split(' ', 1)[0]}",
                         lookups=list(connector.made),
                         loads=None if e.loads is None else list(connector.loads), grammar=e.grammar,
                         throttle_prefills=e.throttle_prefills)


def counts(sched: Scheduler, connector: RecordedConnector, a: SchedulerAssertion) -> str | None:
    """The counts of request ``a.req_id`` that break the assertion ``a``, in
    numbers, as the reference held them when it failed."""
    r = sched.requests.get(a.req_id)
    if r is None:
        return None
    rule = a.rule.split(" ", 1)[0]
    lookup = next((lk for lk in reversed(connector.made) if lk.req == a.req_id), None)
    hit = None
    if lookup is not None and lookup.ext is not None:
        hit = (f"local hit {lookup.local} + external hit {lookup.ext} "
               f"({'async' if lookup.load_async else 'sync'}, the connector's answer at this "
               f"step) = {lookup.local + lookup.ext}")
    if rule == "S:1048" and hit:
        return f"num_computed_tokens = {hit} > num_tokens {r.num_tokens}"
    if rule == "S:1170" and hit:
        left = r.num_tokens - lookup.local - lookup.ext
        return (f"num_computed_tokens = {hit} of num_tokens {r.num_tokens}: "
                f"{max(left, 0)} tokens left to compute")
    if rule == "S:1372":
        k = sched.config.num_spec_tokens
        threshold = sched.config.long_prefill_token_threshold
        return (f"num_scheduled_tokens: one token left to compute, padded to 1 + {k} drafts = "
                f"{1 + k}, cut by long_prefill_token_threshold {threshold}")
    if rule == "BP:679" and hit and lookup.ext and any(g.state for g in sched.config.kv_groups):
        # MambaManager keeps the base allocate_external_computed_blocks (ST:326-367):
        # a block per block of the external hit, where its count took one (ST:1676-1778).
        return (f"an admission with {hit}: each state group takes a block for every block "
                f"the external hit covers, where the count of blocks to allocate took one")
    return f"num_tokens {r.num_tokens}, num_computed_tokens {r.num_computed_tokens}"
