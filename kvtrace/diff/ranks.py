"""What the data-parallel ranks of one run must agree on, checked across their traces.

vLLM 0.32 runs data parallelism in one of two ways (EC: vllm/v1/engine/core.py,
CC: vllm/v1/engine/core_client.py):

* A mixture-of-experts model's ranks run in lockstep (``DPEngineCoreProc``,
  EC:1473-1476, EC:2157-2158). Each pass of a rank's busy loop runs one
  model step on every rank: ``schedule()`` and the model when the rank holds
  requests (EC:2350, EC:665-667), a dummy batch when it has nothing to run
  (EC:2353-2363), as the expert layers exchange tokens across ranks. Each
  pass advances ``step_counter``, the same on every rank (EC:2410-2414); an
  all-reduce at the first pass and every ``dp_sync_interval``-th tells every
  rank whether any still holds unfinished requests, and when none does the
  wave ends on all of them, ``current_wave`` advances and the counter starts
  again at 0 (EC:2370-2393). A step admits new prefills only when the counter
  is a multiple of ``prefill_schedule_interval`` (EC:2318-2325).
* A dense model's ranks are independent engines of rank 0 and size 1
  (EC:1477-1482): nothing runs in lockstep, and their engine core never holds
  prefills back (EC:652-655).

Either way the front end hands each request to one rank and keeps a
streaming-input session's chunks on it (CC:1642-1697), and every rank is
built from one configuration.

The traces hold each rank's header, its arrivals, and each ``schedule()`` call
with its ``throttle_prefills`` flag; not the passes a rank ran without one
(dummy batches), the step counter or the wave. What they allow is checked:

* DP1: every rank's header names the same engine, configuration and
  data-parallel size (the KV cache's size aside: each rank sizes it from its
  own memory, EC:261-340);
* DP2: a request arrives at one rank only;
* DP3: while a rank holds unfinished requests (and is not paused, which
  makes its scheduler count fewer, S:2803-2811), every pass runs its
  ``schedule()``, so its steps count the shared counter one by one: under
  lockstep the steps that admit prefills come every interval-th step (and
  never more than interval - 1 held back in a row); an engine core not in
  lockstep, or with an interval of 1, holds no step back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .._text import count
from ..findings import Divergence
from ..trace.events import Abort, Arrival, Header, Output, PauseState, Step, StepFailed
from ..trace.io import TraceError, TraceReader

DP1 = ("DP1: the ranks of one run are built from one configuration: the same engine, "
       "scheduler settings and data-parallel size (EC:1473-1482)")
DP2 = ("DP2: the front end hands each request to one data-parallel rank and keeps it there "
       "(CC:1642-1697)")
DP3_LOCKSTEP = ("DP3: ranks in lockstep admit prefills only at steps whose shared step counter "
                "is a multiple of prefill_schedule_interval; a rank holding unfinished requests "
                "counts every pass with a step (EC:2318-2325, EC:2350-2373, EC:2410-2414)")
DP3_NEVER = ("DP3: an engine core not in lockstep, or whose prefill_schedule_interval is 1, "
             "never holds prefills back (EC:652-655, EC:2318-2325)")

# Header keys each rank sets for itself.
PER_RANK = frozenset({"config.num_blocks"})


@dataclass
class RankChecks:
    """The checks across a run's ranks: each divergence with the rank whose trace shows it."""

    divergences: list[tuple[int, Divergence]] = field(default_factory=list)
    requests: int = 0          # distinct requests the ranks' arrivals name
    steps_checked: int = 0     # steps whose throttle flag DP3 judged
    unread: dict[int, str] = field(default_factory=dict)   # rank -> why its trace was not read


def check_ranks(ranks: dict[int, str | os.PathLike], lockstep: bool) -> RankChecks:
    """DP1-DP3 over the traces of a run's ranks (rank -> path); ``lockstep``:
    the ranks' headers name a data-parallel size above 1."""
    out = RankChecks()
    headers: dict[int, Header] = {}
    seen: dict[str, int] = {}
    for rank, path in sorted(ranks.items()):
        try:
            scan = _scan(path, lockstep)
        except TraceError as e:
            out.unread[rank] = str(e)
            continue
        headers[rank] = scan.header
        out.steps_checked += scan.cadence.checked
        out.divergences += [(rank, d) for d in scan.cadence.found]
        out.divergences += _elsewhere(rank, scan.arrivals, seen)
    out.divergences[:0] = same_run(headers)
    out.requests = len(seen)
    return out


def same_run(headers: dict[int, Header]) -> list[tuple[int, Divergence]]:
    """DP1: each rank's header against the lowest rank's."""
    if not headers:
        return []
    first = min(headers)
    base = _shape(headers[first])
    out = []
    for rank in sorted(headers)[1:]:
        mine = _shape(headers[rank])
        for key in sorted((base.keys() | mine.keys()) - PER_RANK):
            if base.get(key) != mine.get(key):
                out.append((rank, Divergence(None, None, key, mine.get(key), base.get(key), DP1,
                                             "diff", why=f"rank {first}'s header names "
                                                         f"{base.get(key)!r}")))
    return out


def _shape(h: Header) -> dict[str, Any]:
    config = msgspec.to_builtins(h.config)
    return {"engine": h.engine, "engine_version": h.engine_version, "counters": h.counters,
            **{f"config.{k}": v for k, v in config.items()},
            **{f"features.{k}": v for k, v in h.features.named().items()}}


def _elsewhere(rank: int, arrivals: dict[str, tuple[int, int | None]],
               seen: dict[str, int]) -> list[tuple[int, Divergence]]:
    """DP2: the requests of ``rank`` that an earlier rank already holds."""
    out = []
    for req, (seq, line) in arrivals.items():
        other = seen.setdefault(req, rank)
        if other != rank:
            out.append((rank, Divergence(None, req, "rank", rank, other, DP2, "diff", seq, line,
                                         why=f"{req} arrived at rank {other} too")))
    return out


@dataclass
class _Scan:
    header: Header
    cadence: "Cadence"
    arrivals: dict[str, tuple[int, int | None]]


def _scan(path: str | os.PathLike, lockstep: bool) -> _Scan:
    """One pass over a rank's trace: its arrivals and DP3."""
    with TraceReader(path) as r:
        f = r.header.features
        interval = (f.prefill_schedule_interval or 1) if lockstep else 1
        scan = _Scan(r.header, Cadence(interval), {})
        for e in r:
            if isinstance(e, Arrival) and e.req not in scan.arrivals:
                scan.arrivals[e.req] = (e.seq, r.last_line)
            scan.cadence.feed(e, r.last_line)
    return scan


class Cadence:
    """DP3 over one rank's records, in their order. ``interval``: the steps
    between two that admit prefills (1: every step admits them)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.live: set[str] = set()     # requests arrived and not finished
        self.paused = False             # a pause state: the scheduler counts fewer unfinished
        self.held = False               # live requests held since the last step, throughout
        self.since: int | None = None   # the shared counter, modulo the interval, in this stretch
        self.last: int | None = None    # the stretch's last step at a multiple of the interval
        self.lead = 0                   # steps held back at this stretch's start
        self.checked = 0
        self.found: list[Divergence] = []

    def feed(self, e: Any, line: int | None) -> None:
        if isinstance(e, Step):
            self._step(e, line)
            self.held = bool(self.live) and not self.paused
            return
        if isinstance(e, PauseState):   # S:2803-2811: paused, fewer requests count as unfinished
            self.paused = e.state != "UNPAUSED"
            self.held = self.held and not self.paused
        elif isinstance(e, Arrival):
            self.live.add(e.req)
        elif isinstance(e, Abort):
            self.live.difference_update(e.reqs)
        elif isinstance(e, Output):
            self.live.difference_update(e.finished)
        elif isinstance(e, StepFailed):
            self.held = False
        if not self.live:
            self.held = False

    def _step(self, e: Step, line: int | None) -> None:
        held_back = e.throttle_prefills
        if self.interval == 1:
            self.checked += 1
            if held_back:
                self._flag(e, line, DP3_NEVER, "this engine core admits prefills at every step")
            return
        if not self.held:   # a new stretch: the counter may have moved on unseen
            self.since, self.last, self.lead = (None, None, 1) if held_back else (0, e.step, 0)
            return
        self.checked += 1
        if self.since is None:
            self._lead(e, line, held_back)
            return
        # The counter moves on one a step, whatever a step's flag says.
        self.since = (self.since + 1) % self.interval
        due = self.since == 0
        if held_back == due:
            self._flag(e, line, DP3_LOCKSTEP,
                       f"{count(e.step - self.last, 'step')} after step {self.last}, where the "
                       f"shared counter was a multiple of {self.interval}, it is "
                       f"{'' if due else 'not '}one")
        if due:
            self.last = e.step

    def _lead(self, e: Step, line: int | None, held_back: bool) -> None:
        """A step of a stretch that has admitted no prefill yet."""
        if not held_back:
            self.since, self.last, self.lead = 0, e.step, 0
            return
        self.lead += 1
        if self.lead >= self.interval:
            self._flag(e, line, DP3_LOCKSTEP,
                       f"{count(self.lead, 'step')} in a row held prefills back, with requests "
                       f"held all along: the shared counter reaches a multiple of "
                       f"{self.interval} within {self.interval} steps")
            self.lead = 0

    def _flag(self, e: Step, line: int | None, rule: str, why: str) -> None:
        self.found.append(Divergence(e.step, None, "throttle_prefills", e.throttle_prefills,
                                     not e.throttle_prefills, rule, "invariant", e.seq, line,
                                     why=why))
