"""What replay and diff hand a reporter: one result type each, defined here,
beside the findings they carry, so that a reporter (kvtrace/report/) reads them
typed, and never imports the checker that made them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace._text import path_text
from kvtrace.findings import Divergence, Stop
from kvtrace.trace import events as ev


@dataclass
class ReplayResult:
    path: str
    header: ev.Header
    divergences: list[Divergence] = field(default_factory=list)
    steps: int = 0                    # steps checked: the last step replayed, plus one
    events: int = 0
    truncation: str | None = None     # where and why the trace stops early
    stopped: str | None = None        # why replay stopped before the end of the trace
    steps_in_trace: int = 0           # the trace's last step, plus one (past a stop too)
    stopped_at: Stop | None = None    # where replay stopped with steps left unchecked
    device: str | None = None         # where the shadow-KV check ran; None when off
    assumed_loads: bool = False       # the trace had no load plan; loads were inferred
    slots_checked: int = 0            # KV slots the shadow-KV check verified
    states_checked: int = 0           # state reads (state groups) it verified
    end: ev.End | None = None
    profile: str | None = None        # the version profile the reference followed
    profile_note: str | None = None   # why that one, when the trace's release has none
    audit: dict | None = None         # what the data-path checks checked (kv_audit records)
    # Why the shadow-KV check, asked for, did not run (a model it does not cover).
    content_unchecked: str | None = None
    # The step of the keyframe replay started from (None: the trace's start).
    from_keyframe: int | None = None
    # A segment directory: the steps [first, last) missing between its segments.
    gaps: list[tuple[int, int]] = field(default_factory=list)

    @property
    def steps_checked(self) -> int:
        return self.steps - (self.from_keyframe or 0) - sum(b - a for a, b in self.gaps)


@dataclass(slots=True)
class DiffResult:
    path_a: str
    path_b: str
    header_a: ev.Header
    header_b: ev.Header
    divergences: list[Divergence]
    only_a: list[str]
    only_b: list[str]
    requests_compared: int
    divergent_requests: int
    steps_a: int
    steps_b: int
    truncation_a: str | None = None
    truncation_b: str | None = None
    matched_by: str = "id"  # how requests were paired (see diff_files)
    end_a: ev.End | None = None   # each trace's end record (None: cut off)
    end_b: ev.End | None = None
    # Requests a cut-off trace holds only before its cut: their history in the
    # other trace after the cut is not compared.
    cut_short: list[str] = field(default_factory=list)
    # matched_by "handoff": which trace ("a" or "b") is the prefill side.
    prefill_side: str | None = None

    @property
    def identical(self) -> bool:
        return not self.divergences

    def summary(self) -> dict:
        return {
            "requests_compared": self.requests_compared,
            "divergent_requests": self.divergent_requests,
            "only_in_a": self.only_a,
            "only_in_b": self.only_b,
            "steps_a": self.steps_a,
            "steps_b": self.steps_b,
            "matched_by": self.matched_by,
            "cut_short": self.cut_short,
            **({"prefill_side": self.prefill_side} if self.prefill_side else {}),
        }

    def to_json(self) -> dict:
        return {
            "a": {"path": path_text(self.path_a), "engine": self.header_a.engine,
                  "engine_version": self.header_a.engine_version,
                  "steps": self.steps_a, "truncation": self.truncation_a,
                  "end": _end_json(self.end_a)},
            "b": {"path": path_text(self.path_b), "engine": self.header_b.engine,
                  "engine_version": self.header_b.engine_version,
                  "steps": self.steps_b, "truncation": self.truncation_b,
                  "end": _end_json(self.end_b)},
            "summary": self.summary(),
            "divergences": [d.to_json() for d in self.divergences],
        }


def _end_json(end: ev.End | None) -> dict | None:
    if end is None:
        return None
    return {"status": end.status, "error": end.error, "dropped_events": end.dropped_events}


@dataclass
class HandoffTrace:
    """One trace of a fleet's handoff diff: its side and what it holds."""

    path: str
    header: ev.Header
    role: str                         # "prefill", "decode" or "both" (a kv_both engine)
    steps: int = 0
    handed_over: int = 0              # prefill-side requests handed over
    pulls: int = 0                    # decode-side requests that pull a remote prefill
    truncation: str | None = None
    end: ev.End | None = None


@dataclass
class HandoffsResult:
    """Every decode-side request of several traces paired with its prefill-side
    request in any of them (``kvtrace diff --match handoff`` of many traces)."""

    traces: list[HandoffTrace]
    # each pair's first failed check: (decode trace, prefill trace or None, divergence),
    # the traces as indexes into ``traces``
    divergences: list[tuple[int, int | None, Divergence]] = field(default_factory=list)
    compared: int = 0                 # decode requests paired with a prefill request
    unread: dict[int, list[str]] = field(default_factory=dict)    # handed over, read by none
    unknown: dict[int, list[str]] = field(default_factory=dict)   # naming a request none holds

    @property
    def divergent(self) -> int:
        return len({(d, div.req) for d, _, div in self.divergences})


@dataclass
class RanksResult:
    """The data-parallel ranks of one run replayed together, and the checks across them."""

    path: str                         # rank 0's trace, as named
    size: int | None                  # the size the headers name; None: not recorded
    lockstep: bool                    # the ranks run in lockstep (a mixture-of-experts model)
    # rank, its trace, its replay (None when unusable), and why not
    ranks: list[tuple[int, str, ReplayResult | None, str | None]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    others: list[tuple[str, str]] = field(default_factory=list)   # files not taken, and why
    # the checks across ranks: each divergence with the rank whose trace shows it
    across: list[tuple[int, Divergence]] = field(default_factory=list)
    requests: int = 0                 # distinct requests the ranks hold
    steps_checked: int = 0            # steps whose throttle flag the cadence check judged
    unread: dict[int, str] = field(default_factory=dict)   # ranks the checks could not read


_NOTES = 5  # entries of each input-note list that summary() shows


@dataclass
class VllmReplayResult:
    path: str                     # the recorded trace
    out: str                      # the trace this scheduler's decisions were written to
    scheduler_cls: str            # dotted name of the scheduler class that ran
    vllm_version: str
    steps: int = 0                # schedule() calls made
    events: int = 0               # recorded events fed
    seconds: float = 0.0          # wall time of the replay loop (set-up excluded)
    setup_seconds: float = 0.0    # building the config and the scheduler
    truncation: str | None = None  # where and why the recorded trace stops early
    stopped: str | None = None    # why the replay stopped before the end of the trace
    # Differences the replay cannot avoid, known before it starts.
    notes: list[str] = field(default_factory=list)
    # "step S: REQ looked up (local=L) with no recorded answer; answered 0"
    unanswered_lookups: list[str] = field(default_factory=list)
    # "step S: recorded lookup of REQ (local=L, ext=E) was not asked for"
    unused_lookups: list[str] = field(default_factory=list)
    # "step S: sampled tokens for REQ, which this scheduler did not schedule"
    dropped_samples: list[str] = field(default_factory=list)
    # The first step whose decisions differ from the recording's: (step,
    # request, what, recorded, this scheduler's); None when every step agrees.
    first_difference: tuple | None = None

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("inf")

    @property
    def faithful_inputs(self) -> bool:
        """True when every recorded input was used exactly as recorded."""
        return not (self.unanswered_lookups or self.unused_lookups or self.dropped_samples
                    or self.stopped)

    def summary(self) -> dict:
        return {
            "path": self.path, "out": self.out, "scheduler_cls": self.scheduler_cls,
            "vllm_version": self.vllm_version, "steps": self.steps, "events": self.events,
            "seconds": round(self.seconds, 4), "setup_seconds": round(self.setup_seconds, 3),
            "steps_per_s": round(self.steps_per_s, 1) if self.seconds > 0 else None,
            "truncation": self.truncation, "stopped": self.stopped, "notes": self.notes,
            "first_difference": (None if self.first_difference is None else
                                 dict(zip(("step", "req", "field", "recorded", "vllm"),
                                          self.first_difference))),
            # Counts, with the first few entries of each list.
            "unanswered_lookups": len(self.unanswered_lookups),
            "unused_lookups": len(self.unused_lookups),
            "dropped_samples": len(self.dropped_samples),
            "input_notes": (self.unanswered_lookups[:_NOTES] + self.unused_lookups[:_NOTES]
                            + self.dropped_samples[:_NOTES]),
        }
