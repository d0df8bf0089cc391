"""Checks of each record that need no reference, as a recording is written.

``Watch`` runs the invariants a record shows wrong by itself, or with what
the records before it said: the replay's own checks of a step record
(``checks.step_invariants``: I1, I4-I7, I9, B1, B6, the null block), the
prompt stats' bounds (``checks.stats_invariants``: 5.3, L1-L4), and two of
the block pool's (``checks.blocks_held``: a block in two tables where no
prefix hit can share it, and more blocks held and free than the pool has).
None of them can break on a correct engine: each is a bound the engine
itself keeps. A flight recorder pins the segments around the first one
broken; it costs a pass over the step's states, no scheduling.

Where the replay needs the reference's state, the watch takes a bound from
the records: the output placeholders of a step under async scheduling are
at most one for each step in flight that scheduled the request (and one for
each draft it scheduled), and a request's preemptions are adopted as
recorded after a prefix-cache reset that preempted running requests.
"""

from __future__ import annotations

from kvtrace.replay import checks
from kvtrace.trace import events as ev

Divergence = checks.Divergence

# Async scheduling: a step whose output has not come this many steps later never will.
_OUTPUT_WINDOW = 64


class Watch:
    """``feed`` takes a trace's records in order and returns what each broke."""

    def __init__(self, header: ev.Header):
        self.cfg = header.config
        f = header.features
        self.windowed = checks.null_blocks(f)
        groups = f.kv_cache_groups or ()
        self.block_sizes = (tuple(None if g.kind == "MambaSpec" else g.block_size
                                  for g in groups) or (self.cfg.block_size,))
        self.preemptions: dict[str, int] = {}
        # Async scheduling: per step with no output yet, the most placeholders
        # it holds for each request it scheduled.
        self.in_flight: dict[int, dict[str, int]] | None = {} if f.async_scheduling else None
        self.no_cache: set[str] = set()        # requests that read no prefix cache
        self.prompt: dict[str, int] = {}       # a plain request's prompt length
        self.sessions: set[str] = set()        # streaming-input sessions: their tokens change
        self.adopt: set[str] = set()           # preemption counts to take as recorded
        self.live: set[str] = set()

    def feed(self, e) -> list[Divergence]:
        kind = type(e)
        if kind is ev.Step:
            return self._step(e)
        if kind is ev.Output:
            self._output(e)
        elif kind is ev.PromptStats:
            return checks.stats_invariants(e, self.prompt.get(e.req))
        elif kind is ev.Arrival:
            self._arrival(e)
        elif kind is ev.Abort:
            self._gone(e.reqs)
        elif kind is ev.ResetPrefixCache and e.reset_running_requests:
            # Running requests are preempted, listed in no output on some
            # releases: their counts are taken as the next step records them.
            self.adopt |= self.live
        return []

    def _arrival(self, a: ev.Arrival) -> None:
        req = a.req
        if req in self.live:   # a session's next input chunk, or the end of its input
            self.sessions.add(req)
            self.prompt.pop(req, None)
            return
        self.live.add(req)
        self.preemptions.pop(req, None)
        self.adopt.discard(req)
        if a.resumable:
            self.sessions.add(req)
        else:
            self.sessions.discard(req)
            self.prompt[req] = len(a.prompt_token_ids)
        if a.skip_reading_prefix_cache:
            self.no_cache.add(req)
        else:
            self.no_cache.discard(req)

    def _gone(self, reqs) -> None:
        for req in reqs:
            self.live.discard(req)
            self.preemptions.pop(req, None)
            self.prompt.pop(req, None)
            self.no_cache.discard(req)
            self.sessions.discard(req)
            self.adopt.discard(req)

    def _step(self, rec: ev.Step) -> list[Divergence]:
        if self.adopt:
            for s in rec.states:
                if s.req in self.adopt:
                    self.adopt.discard(s.req)
                    self.preemptions[s.req] = s.num_preemptions - (s.req in rec.preempted)
        in_flight = None
        if self.in_flight is not None:
            in_flight = self._placeholders(rec)
        found = checks.step_invariants(rec, self.cfg, self.preemptions, None, in_flight,
                                       self.no_cache.__contains__, self.windowed)
        found += checks.blocks_held(rec, self.cfg, self.block_sizes, self._unshared)
        return found

    def _unshared(self, req: str) -> bool:
        return req in self.prompt and req not in self.sessions

    def _placeholders(self, rec: ev.Step) -> dict[str, int]:
        """Per request, the most output placeholders the steps in flight hold
        for it: one for each that scheduled it, and one for each draft."""
        flight = self.in_flight
        for old in [k for k in flight if k < rec.step - _OUTPUT_WINDOW]:
            del flight[old]
        held: dict[str, int] = {}
        for per in flight.values():
            for req, n in per.items():
                held[req] = held.get(req, 0) + n
        spec = rec.spec or {}
        mine = {s.req: 1 + len(spec.get(s.req, ())) for s in (*rec.new, *rec.resumed, *rec.running)}
        if mine:
            flight[rec.step] = mine
        return held

    def _output(self, rec: ev.Output) -> None:
        if self.in_flight is not None:
            self.in_flight.pop(rec.step, None)
        if rec.finished:
            turns = rec.turn_ends()
            self._gone([r for r in rec.finished if r not in turns])


def broken_at(d: Divergence) -> str:
    """A divergence as one line: the step, the request, what was recorded and
    the rule's id."""
    who = f"request {d.req}, " if d.req is not None else ""
    return f"step {d.step}: {who}{d.field} {d.recorded!r} (expected {d.expected}; {rule_id(d.rule)})"


def rule_id(rule: str) -> str:
    """The id a rule's text starts with: ``I1``, ``S:1372``, ``4.5/4.7``."""
    first = rule.split()[0] if rule.split() else rule
    return first.rstrip(":")
