"""The run summary's figures, as ``summarize`` leaves them: step series
downsampled into min/max buckets (``Series``), request timelines with their
marks and history rows, and the run's counts (``RunSummary``)."""

from __future__ import annotations


from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from .._text import count
from ..trace import events as ev

SERIES_POINTS = 2000        # at most this many points per run-level series
TIMELINE_POINTS = 600       # ... and per request series
MAX_MARKS = 400             # marks kept per request timeline


# --------------------------------------------------------------------------- series


class Series:
    """A step series downsampled on the fly.

    Points arrive with non-decreasing x. They fall into buckets of ``width``
    consecutive x values; a bucket keeps its lowest and its highest point (and
    the last one, for step-function plots), so spikes survive downsampling. When
    there are more than ``max_points // 2`` buckets, the width doubles and
    neighbouring buckets merge. Memory is bounded by ``max_points``.
    """

    __slots__ = ("max_buckets", "width", "buckets", "count", "last")

    def __init__(self, max_points: int = SERIES_POINTS):
        self.max_buckets = max(1, max_points // 2)
        self.width = 1
        # [key, (x, y) of min, (x, y) of max]
        self.buckets: list[list] = []
        self.count = 0
        self.last: tuple[int, float] | None = None

    def add(self, x: int, y: float) -> None:
        self.count += 1
        self.last = (x, y)
        key = x // self.width
        b = self.buckets[-1] if self.buckets else None
        if b is not None and b[0] == key:
            if y < b[1][1]:
                b[1] = (x, y)
            if y >= b[2][1]:
                b[2] = (x, y)
            return
        self.buckets.append([key, (x, y), (x, y)])
        if len(self.buckets) > self.max_buckets:
            self._halve()

    def _halve(self) -> None:
        self.width *= 2
        merged: list[list] = []
        for key, lo, hi in self.buckets:
            k = min(lo[0], hi[0]) // self.width
            if merged and merged[-1][0] == k:
                m = merged[-1]
                if lo[1] < m[1][1]:
                    m[1] = lo
                if hi[1] >= m[2][1]:
                    m[2] = hi
            else:
                merged.append([k, lo, hi])
        self.buckets = merged

    def points(self) -> list[tuple[int, float]]:
        """The kept points in x order (min and max of each bucket), plus the last."""
        out: list[tuple[int, float]] = []
        for _, lo, hi in self.buckets:
            pair = (lo, hi) if lo[0] <= hi[0] else (hi, lo)
            for p in pair:
                if not out or out[-1] != p:
                    out.append(p)
        if self.last is not None and (not out or out[-1] != self.last):
            if out and out[-1][0] > self.last[0]:
                return out
            out.append(self.last)
        return out

    @property
    def max(self) -> float | None:
        return max((b[2][1] for b in self.buckets), default=None)

    def __len__(self) -> int:
        return self.count


# --------------------------------------------------------------------------- records


@dataclass(slots=True)
class Mark:
    """Something that happened to a request at a step: admitted, preempted, a load..."""
    step: int
    kind: str     # arrival, lookup, async-wait, not-ready, load, admitted, resumed,
                  # preempted, load-done, load-failed, finished, aborted
    text: str = ""


@dataclass(slots=True)
class HistoryRow:
    """One step in which the request was scheduled (``history=True`` only)."""
    step: int
    how: str              # "new", "resumed" or "running"
    phase: str            # "prefill" or "decode"
    computed: int         # pre-step num_computed_tokens
    scheduled: int        # num_scheduled_tokens
    new_blocks: list[int]
    blocks: int           # table length after the step
    computed_after: int   # num_computed_tokens after the step
    status: str           # status after the step
    drafts: int = 0       # speculative decoding: drafts scheduled (padding excluded)
    accepted: int | None = None   # ... and accepted, once the step's output says


@dataclass
class RequestTimeline:
    req: str
    index: int                        # arrival order, from 0
    prompt_len: int
    max_tokens: int
    priority: int
    arrival_time: float
    arrival_step: int                 # the step index that followed the arrival
    arrival_line: int
    computed: Series = field(default_factory=lambda: Series(TIMELINE_POINTS))
    cached: Series = field(default_factory=lambda: Series(TIMELINE_POINTS))
    external: Series = field(default_factory=lambda: Series(TIMELINE_POINTS))
    blocks: Series = field(default_factory=lambda: Series(TIMELINE_POINTS))
    marks: list[Mark] = field(default_factory=list)
    marks_left_out: int = 0
    history: list[HistoryRow] | None = None
    first_step: int | None = None
    last_step: int | None = None
    steps_scheduled: int = 0
    tokens_scheduled: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    finish_step: int | None = None
    prefill_stats: ev.PrefillStats | None = None
    legacy: ev.LegacyCounters | None = None
    stats_step: int | None = None

    def mark(self, step: int, kind: str, text: str = "") -> None:
        if self.history is not None or len(self.marks) < MAX_MARKS:
            self.marks.append(Mark(step, kind, text))
        else:
            self.marks_left_out += 1


@dataclass
class RunSummary:
    path: str
    header: ev.Header
    steps: int = 0
    events: int = 0
    requests: int = 0
    finished: Counter = field(default_factory=Counter)   # finish reason -> count
    aborted: int = 0
    preemptions: int = 0
    preempted_requests: int = 0
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_live: int = 0
    # prompt-token accounting (from prompt_stats)
    stats_requests: int = 0
    prompt_tokens: int = 0
    local_cached_tokens: int = 0
    external_cached_tokens: int = 0
    cache_creation_tokens: int = 0
    # connector
    lookups: int = 0
    lookups_not_ready: int = 0
    lookups_async: int = 0
    lookup_local_tokens: int = 0
    lookup_external_tokens: int = 0
    loads: int = 0
    load_tokens: int = 0
    finished_recving: int = 0
    failed_recving: int = 0
    invalid_blocks: int = 0
    drafts_scheduled: int = 0         # speculative decoding (padding excluded)
    drafts_accepted: int = 0
    structured: int = 0               # requests with a structured output
    grammar_ready: int = 0            # ... whose grammar a step found compiled
    grammar_wait_steps: int = 0       # steps from their arrival to that step, in all
    grammar_failed: int = 0           # grammars that failed to compile
    grammar_rejected: int = 0         # grammars that refused the tokens sampled
    embeds: int = 0                   # requests whose prompt is given as embeddings
    embeds_mixed: int = 0             # ... of them with positions given as token ids
    # series over steps
    kv_used: Series = field(default_factory=Series)           # blocks in use after each step
    sched_tokens: Series = field(default_factory=Series)      # tokens scheduled per step
    running: Series = field(default_factory=Series)           # requests scheduled per step
    live: Series = field(default_factory=Series)              # requests arrived and not finished
    preemption_steps: list[int] = field(default_factory=list)
    peak_kv_used: int | None = None
    kv_used_sum: int = 0
    kv_samples: int = 0
    # timelines
    timelines: dict[str, RequestTimeline] = field(default_factory=dict)
    truncation: str | None = None
    end: ev.End | None = None
    last_line: int = 0

    @property
    def usable_blocks(self) -> int:
        return self.header.config.num_blocks - 1

    @property
    def prefix_hit_rate(self) -> float | None:
        """Share of prompt tokens served by the local prefix cache."""
        return self.local_cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def external_hit_rate(self) -> float | None:
        """Share of prompt tokens served by the KV connector."""
        return self.external_cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def mean_kv_used(self) -> float | None:
        return self.kv_used_sum / self.kv_samples if self.kv_samples else None

    @property
    def timelines_left_out(self) -> int:
        return max(0, self.requests - len(self.timelines))


def percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def kv_groups_text(features: ev.SchedulerFeatures) -> str | None:
    """A header's KV-cache groups in words ("group 0: sliding window of 64
    tokens, group 1: full attention", "group 0: state (gdn_attn, align)"),
    or None for one full-attention group."""
    groups = features.kv_cache_groups
    if not groups:
        return None
    return ", ".join(f"group {i}: {_group_kind(g)}" for i, g in enumerate(groups))


def _group_kind(g: ev.KVCacheGroup) -> str:
    if g.sliding_window:
        return f"sliding window of {count(g.sliding_window, 'token')}"
    if g.kind == "MambaSpec":
        return (f"state ({g.mamba_type or 'Mamba'}, {g.mamba_cache_mode}, "
                f"blocks of {count(g.block_size, 'token')})")
    return "full attention"


# --------------------------------------------------------------------------- marks

MAX_RUNS = 400              # bands drawn per chart


def step_runs(steps: Iterable[int], max_runs: int = MAX_RUNS) -> list[tuple[int, int]]:
    """Runs of consecutive steps, as (first, last). When there are more than
    ``max_runs``, runs closer than a gap merge, the gap doubling until they fit,
    so a chart of a long trace draws a bounded number of bands."""
    runs: list[list[int]] = []
    for k in sorted(set(steps)):
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    gap = 1
    while len(runs) > max(1, max_runs):
        gap *= 2
        merged: list[list[int]] = []
        for a, b in runs:
            if merged and a - merged[-1][1] <= gap:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        runs = merged
    return [(a, b) for a, b in runs]
