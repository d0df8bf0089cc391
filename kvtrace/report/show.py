"""``kvtrace show``: the run summary, one request's history, or one step, in the terminal."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._text import count, number as _n
from ..findings import Divergence, causal_key
from ..rules import rule_id
from .at_step import QUEUES, Placed, StepView, one_request
from .figures import HistoryRow, Mark, RequestTimeline, RunSummary, Series, kv_groups_text, percent
from .summary import summarize
from .failures import print_wrapped, rule_words, value_text, why_text
from .terminal import make_console, replayed_up_to

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60


def show(trace: str | os.PathLike, request: str | None = None, console: Console | None = None,
         collapse_decode: bool = True, divergences: list[Divergence] | None = None,
         note: str | None = None) -> RunSummary:
    """Print the run summary of ``trace``; with ``request``, also that request's history.

    ``request`` is a request id, or a prefix of exactly one (vLLM ids end in a
    random suffix: ``0-a3c1`` finds ``0-a3c17fc3``). Runs of decode steps with
    nothing else happening are printed as one row unless ``collapse_decode`` is
    false. ``divergences`` (a replay's, handed over) are marked on the rows of
    the request's history; ``note`` says why there are none to mark (a replay
    refused). Raises ``TraceError`` for an unusable trace and
    ``UnknownRequest`` when no request, or more than one, matches.
    """
    console = console or make_console()
    if request is None:
        s = summarize(trace, max_timelines=0)
        print_summary(s, console)
        return s
    s, tl = read_request(trace, request)
    print_summary(s, console, brief=True)
    print_request(s, tl, console, collapse_decode=collapse_decode, divergences=divergences,
                  note=note)
    return s


def read_request(trace: str | os.PathLike, request: str) -> tuple[RunSummary, RequestTimeline]:
    """The brief run summary and the whole history of the one request that
    ``request`` names (an id, or a prefix of exactly one); ``UnknownRequest``
    otherwise."""
    s = summarize(trace, keep=lambda r: r.startswith(request), max_timelines=0,
                  history=lambda r: r.startswith(request))
    ids = sorted(s.timelines, key=lambda r: s.timelines[r].index)   # those it begins
    return s, s.timelines[one_request(request, ids, trace, "in the trace", s.requests)]


# --------------------------------------------------------------------------- summary


def sparkline(series: Series, hi: float, width: int = SPARK_WIDTH) -> str:
    """The series as one line of block characters, ``width`` wide at most."""
    pts = series.points()
    if not pts or hi <= 0:
        return ""
    x0, x1 = pts[0][0], pts[-1][0]
    n = min(width, x1 - x0 + 1)
    cols = [None] * n
    for x, y in pts:
        i = min(n - 1, (x - x0) * n // max(1, x1 - x0 + 1))
        cols[i] = y if cols[i] is None else max(cols[i], y)
    last = 0.0
    out = []
    for v in cols:
        last = last if v is None else v
        out.append(SPARK[min(len(SPARK) - 1, max(0, int(last / hi * (len(SPARK) - 1) + 0.5)))])
    return "".join(out)


def print_summary(s: RunSummary, console: Console, brief: bool = False) -> None:
    h = s.header
    cfg = h.config
    print_wrapped(console, f"{s.path} · engine {h.engine} {h.engine_version} · "
                           f"{count(s.steps, 'step')} · {count(s.requests, 'request')}", "bold")
    note = replayed_up_to(s.truncation, "read")
    if note:
        console.print(Text(f"truncated: {note}", style="yellow"))
    if s.end is not None and (s.end.status != "complete" or s.end.dropped_events):
        console.print(Text(f"the recorder closed this trace as '{s.end.status}'"
                           + (f", {count(s.end.dropped_events, 'event')} dropped"
                              if s.end.dropped_events else "")
                           + (f": {s.end.error}" if s.end.error else ""), style="yellow"))
    if brief:
        return
    budget = cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    t.add_row("config", f"block size {_n(cfg.block_size)}, {count(cfg.num_blocks, 'block')} "
                        f"({_n(s.usable_blocks)} usable), token budget {_n(budget)}, max_num_seqs "
                        f"{_n(cfg.max_num_seqs)}, policy {cfg.policy}, "
                        f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}"
                        + (f", connector {cfg.connector.name} (on a failed load: "
                           f"{cfg.connector.load_failure_policy})" if cfg.connector else ""))
    groups = kv_groups_text(h.features)
    if groups:
        t.add_row("KV cache", groups)
    fin = ", ".join(f"{_n(n)} {r}" for r, n in sorted(s.finished.items())) or "none"
    unfinished = s.requests - sum(s.finished.values())
    t.add_row("requests", f"{_n(s.requests)} (finished: {fin}"
                          + (f"; {_n(unfinished)} not finished" if unfinished else "") + f"); "
                          f"at most {_n(s.max_live)} at once")
    t.add_row("steps", f"{_n(s.steps)}: {count(s.scheduled_tokens, 'token')} scheduled "
                       f"({_n(s.prefill_tokens)} prefill, {_n(s.decode_tokens)} decode)")
    t.add_row("preemptions", f"{_n(s.preemptions)} (requests preempted: {_n(s.preempted_requests)})")
    t.add_row("prefix hit rate", f"{percent(s.prefix_hit_rate)} ({_n(s.local_cached_tokens)} of "
                                 f"{count(s.prompt_tokens, 'prompt token')} from the local cache)")
    t.add_row("external hit rate", f"{percent(s.external_hit_rate)} "
                                   f"({count(s.external_cached_tokens, 'prompt token')} from the "
                                   "connector)")
    if s.stats_requests < s.requests:
        t.add_row("", Text(f"prompt stats for {_n(s.stats_requests)} of "
                           f"{count(s.requests, 'request')}", style="dim"))
    if s.lookups or s.loads:
        t.add_row("connector", f"{count(s.lookups, 'lookup')} ({_n(s.lookups_not_ready)} not ready, "
                               f"{_n(s.lookups_async)} async), {count(s.loads, 'load')} "
                               f"({count(s.load_tokens, 'token')}), "
                               f"{count(s.finished_recving, 'async load')} finished, "
                               f"{_n(s.failed_recving)} failed, "
                               f"{count(s.invalid_blocks, 'invalid block')}")
    if s.drafts_scheduled:
        t.add_row("drafts", f"{_n(s.drafts_scheduled)} scheduled, {_n(s.drafts_accepted)} accepted "
                            f"({percent(s.drafts_accepted / s.drafts_scheduled)})")
    if s.structured:
        # The scheduler looks at a grammar when the request comes up in the waiting pass.
        waited = (f", grammar found compiled {s.grammar_wait_steps / s.grammar_ready:,.1f} steps "
                  "after arrival on average" if s.grammar_ready else "")
        t.add_row("structured outputs", f"{count(s.structured, 'request')}{waited}, "
                                        f"{_n(s.grammar_failed)} failed to compile, "
                                        f"{_n(s.grammar_rejected)} refused the tokens sampled")
    if s.embeds:
        t.add_row("prompt embeddings", f"{count(s.embeds, 'request')} ({_n(s.embeds_mixed)} mixed "
                                       "with token ids)")
    if s.peak_kv_used is not None:
        t.add_row("KV usage", f"peak {_n(s.peak_kv_used)}/{count(s.usable_blocks, 'block')}, mean "
                              f"{s.mean_kv_used:,.1f} "
                              f"({percent(s.mean_kv_used / max(1, s.usable_blocks))})")
        t.add_row("", Text(sparkline(s.kv_used, s.usable_blocks), style="cyan"))
    else:
        t.add_row("KV usage", Text("not recorded (no num_free_blocks)", style="dim"))
    t.add_row("tokens/step", Text(sparkline(s.sched_tokens, budget), style="green"))
    console.print(t)


# --------------------------------------------------------------------------- one request

MAX_ROW_DIVERGENCES = 4   # divergence lines under one row; the rest are named in one line
MAX_NEW_BLOCKS = 12       # block ids listed on a row; the rest are counted
GAP = 2                   # spaces between the history's columns


@dataclass
class _Row:
    """One row of a request's history: a mark, a scheduled step, a run of
    decode steps, or a step where only a divergence shows."""

    step: int | None                 # None: a divergence of no step
    step_text: str
    event: Text
    numbers: tuple[str, str, str] | None   # computed before→after, scheduled, table size
    detail: Text
    kind: str                        # a mark's kind, "scheduled", "decode" (a run) or "diverges"
    steps: tuple[int, ...] = ()      # the steps a decode run folds
    divs: list[Divergence] = field(default_factory=list)


def print_request(s: RunSummary, tl: RequestTimeline, console: Console,
                  collapse_decode: bool = True, divergences: list[Divergence] | None = None,
                  note: str | None = None) -> None:
    """The request's history, one line per event in aligned columns (only the
    free-text tail wraps), each divergence of ``divergences`` that concerns it
    under the row of its step."""
    bs = s.header.config.block_size
    console.print(Text(f"request {tl.req}", style="bold"))
    console.print(f"arrival: before step {tl.arrival_step} (line {tl.arrival_line}), prompt "
                  f"{count(tl.prompt_len, 'token')}, max_tokens {_n(tl.max_tokens)}, priority "
                  f"{tl.priority}, "
                  f"arrival_time {tl.arrival_time:.3f}")
    mine = [d for d in divergences or () if d.req == tl.req]
    for line in _layout(_history(tl, collapse_decode, mine), console.width):
        console.print(line, soft_wrap=True)
    if tl.finish_reason:
        console.print(f"finish: {tl.finish_reason} at step {tl.finish_step}")
    else:
        console.print(Text("finish: not finished in the trace", style="yellow"))
    console.print(f"scheduled in {count(tl.steps_scheduled, 'step')}, "
                  f"{count(tl.tokens_scheduled, 'token')}; "
                  f"{count(tl.num_preemptions, 'preemption')}; block size {_n(bs)}")
    if tl.prefill_stats is not None:
        p = tl.prefill_stats
        console.print(f"prompt stats (step {tl.stats_step}): num_prompt_tokens "
                      f"{_n(p.num_prompt_tokens)}, num_local_cached_tokens "
                      f"{_n(p.num_local_cached_tokens)}, num_external_cached_tokens "
                      f"{_n(p.num_external_cached_tokens)}, num_cached_tokens "
                      f"{_n(p.num_cached_tokens)}, num_computed_tokens {_n(p.num_computed_tokens)}, "
                      f"num_cache_creation_tokens {_n(p.num_cache_creation_tokens)}")
    if tl.legacy is not None:
        console.print(f"legacy counters (step {tl.stats_step}): num_cached_tokens "
                      f"{_n(tl.legacy.num_cached_tokens)}, num_external_computed_tokens "
                      f"{_n(tl.legacy.num_external_computed_tokens)}")
    if tl.prefill_stats is None and tl.legacy is None:
        console.print(Text("prompt stats: none recorded", style="dim"))
    if divergences is not None:
        steps = {d.step for d in mine}
        console.print(Text(
            f"divergences: {_n(len(mine))} at {count(len(steps), 'step')}, "
            f"marked ! (kvtrace replay --request {tl.req} tells each whole)" if mine
            else "divergences: none (replayed)", style="bold red" if mine else "dim"))
    if note:   # why none are marked, or where the replay stopped short of the end
        console.print(Text(f"divergences: {note}", style="yellow"))


_MARK_STYLE = {"preempted": "bold yellow", "load": "cyan", "async-wait": "cyan", "load-done": "cyan",
               "load-failed": "bold red", "finished": "green", "aborted": "red", "not-ready": "dim",
               "lookup": "cyan", "arrival": "bold"}

# Where a divergence shows when a step has several rows: on the row of the
# event it concerns, else on the scheduled step's row, else the first.
_ROW_OF_FIELD = {"finish_reason": ("finished", "aborted"), "finished_req_ids": ("finished", "aborted"),
                 "preempted": ("preempted",), "num_preemptions": ("preempted",),
                 "lookup": ("lookup", "async-wait", "not-ready"),
                 "local_hit": ("lookup", "async-wait", "not-ready"),
                 "kv_load": ("load",), "kv-load": ("load",)}


def _history(tl: RequestTimeline, collapse: bool, divs: list[Divergence]) -> list[_Row]:
    """Marks and scheduled steps merged in step order, runs of plain decode
    steps folded (a run goes on while its steps diverge alike), and ``divs``
    on the rows of their steps (a row of its own where the request has none)."""
    at: dict[int | None, list[Divergence]] = {}
    for d in sorted(divs, key=causal_key):
        at.setdefault(d.step, []).append(d)

    def alike(step: int) -> frozenset:
        return frozenset((d.field, rule_id(d.rule)) for d in at.get(step, ()))

    marks = [m for m in tl.marks if m.kind not in ("admitted", "resumed")]
    split = {m.step: m.text.split(" (", 1)[1].split(")", 1)[0] for m in tl.marks
             if m.kind in ("admitted", "resumed") and " (" in m.text}
    items: list[tuple[int, int, object]] = []
    for m in marks:
        # At one step: lookups and loads before the scheduling, finishes after it.
        order = 2 if m.kind in ("finished", "aborted", "load-done", "load-failed") else 0
        items.append((m.step, order, m))
    for r in tl.history or ():
        items.append((r.step, 1, r))
    items.sort(key=lambda t: (t[0], t[1]))
    marked = {m.step for m in marks}
    admitted = {r.step for r in tl.history or () if r.how != "running"}
    rows: list[_Row] = []
    run: list[HistoryRow] = []

    def flush():
        if len(run) == 1:
            rows.append(_hist_row(run[0], split))
        elif run:
            rows.append(_run_row(run))
        run.clear()

    for _, _, it in items:
        if isinstance(it, HistoryRow):
            plain = (collapse and it.how == "running" and it.phase == "decode" and it.step not in marked)
            if plain and run and run[-1].step == it.step - 1 and alike(it.step) == alike(run[-1].step):
                run.append(it)
                continue
            flush()
            if plain:
                run.append(it)
            else:
                rows.append(_hist_row(it, split))
        else:
            flush()
            rows.append(_mark_row(it))
            if it.kind == "lookup" and it.step not in admitted and "not admitted" not in it.text:
                rows[-1].detail.append("; not admitted")
    flush()

    by_step: dict[int, list[_Row]] = {}
    for r in rows:
        for k in r.steps or (r.step,):
            by_step.setdefault(k, []).append(r)
    for step, ds in at.items():
        here = by_step.get(step) if step is not None else None
        if not here:
            rows.append(_Row(step, "" if step is None else str(step), Text("diverges", style="red"),
                             None, Text(""), "diverges", divs=ds))
            continue
        for d in ds:
            kinds = _ROW_OF_FIELD.get("lookup" if d.field.startswith("lookup.") else d.field, ())
            target = (next((r for r in here if r.kind in kinds), None)
                      or next((r for r in here if r.kind in ("scheduled", "decode")), here[0]))
            target.divs.append(d)
    order = {id(r): i for i, r in enumerate(rows)}
    rows.sort(key=lambda r: (float("inf") if r.step is None else r.step, order[id(r)]))
    return rows


def _hist_row(r: HistoryRow, split: dict[int, str]) -> _Row:
    how = {"new": "admitted", "resumed": "resumed", "running": "scheduled"}[r.how]
    detail = f"{r.phase}" + (f", {r.status}" if r.status != "RUNNING" else "")
    if r.drafts:
        detail += (f", {_n(r.accepted)} of {count(r.drafts, 'draft')} accepted"
                   if r.accepted is not None else f", {count(r.drafts, 'draft')}")
    if r.how != "running" and r.step in split:
        source = split[r.step]
        detail += f", {source}" if source.endswith("last turn") else f", hit: {source}"
    if r.new_blocks:
        more = len(r.new_blocks) - MAX_NEW_BLOCKS
        detail += (f"; new blocks {_ids(r.new_blocks[:MAX_NEW_BLOCKS])}"
                   + (f" and {_n(more)} more" if more > 0 else ""))
    return _Row(r.step, str(r.step), Text(how, style="bold" if r.how != "running" else ""),
                (f"{_n(r.computed)}→{_n(r.computed_after)}", _n(r.scheduled), _n(r.blocks)),
                Text(detail), "scheduled", steps=(r.step,))


def _run_row(run: list[HistoryRow]) -> _Row:
    a, b = run[0], run[-1]
    nb = sum(len(r.new_blocks) for r in run)
    drafts = sum(r.drafts for r in run)
    detail = count(len(run), "decode step")
    if drafts:
        detail += f", {_n(sum(r.accepted or 0 for r in run))} of {count(drafts, 'draft')} accepted"
    if nb:
        detail += f"; {count(nb, 'new block')}"
    return _Row(a.step, f"{a.step}–{b.step}", Text("decode", style="dim"),
                (f"{_n(a.computed)}→{_n(b.computed_after)}", _n(sum(r.scheduled for r in run)),
                 _n(b.blocks)),
                Text(detail, style="dim"), "decode", steps=tuple(r.step for r in run))


def _mark_row(m: Mark) -> _Row:
    return _Row(m.step, str(m.step), Text(m.kind, style=_MARK_STYLE.get(m.kind, "")), None,
                Text(m.text), m.kind)


def _layout(rows: list[_Row], width: int) -> list[Text]:
    """The rows in aligned columns: mark, step, event, then computed,
    scheduled and table size for a scheduled step, and the detail, which
    alone wraps (at spaces: no word is cut). A mark has no numbers: its text
    starts where they would. Each divergence follows its row on lines of its own."""
    head = ("step", "event", "computed", "sched", "blocks")
    w = [max([len(head[0])] + [len(r.step_text) for r in rows]),
         max([len(head[1])] + [len(r.event.plain) for r in rows])]
    w += [max([len(head[i + 2])] + [len(r.numbers[i]) for r in rows if r.numbers]) for i in range(3)]
    x_event = 2 + w[0] + GAP
    x_numbers = x_event + w[1] + GAP
    x_detail = x_numbers + sum(w[2:]) + 3 * GAP
    gap = " " * GAP
    title = Text("  " + gap.join([head[0].rjust(w[0]), head[1].ljust(w[1]),
                                  *(h.rjust(n) for h, n in zip(head[2:], w[2:]))]) + gap + "detail",
                 style="bold")
    out = [title]
    for r in rows:
        line = Text()
        line.append("! " if r.divs else "  ", style="bold red")
        line.append(r.step_text.rjust(w[0]) + gap)
        line.append_text(r.event)
        if r.numbers:
            line.append(" " * (w[1] - len(r.event.plain)) + gap)
            line.append(gap.join(v.rjust(n) for v, n in zip(r.numbers, w[2:])) + gap)
            x = x_detail
        else:
            line.append(" " * (w[1] - len(r.event.plain)) + gap)
            x = x_numbers
        out += _hang(line, r.detail, x, width)
        out += _div_lines(r, x_event, width)
    return out


def _hang(head: Text, tail: Text, x: int, width: int) -> list[Text]:
    """``head`` (``x`` cells) followed by ``tail`` wrapped to the rest of the
    line, continuation lines starting at ``x``. A word too long for that goes
    on a line of its own, moved left as far as it must: never cut."""
    pieces = _wrap(tail, max(1, width - x))
    if not pieces:
        return [head]
    lines = []
    for i, piece in enumerate(pieces):
        pad = min(x, max(0, width - len(piece.plain)))
        if i == 0 and pad == x:
            line = head.copy()
        else:
            if i == 0:
                lines.append(head.copy())
            line = Text(" " * pad)
        line.append_text(piece)
        lines.append(line)
    for line in lines:
        line.rstrip()   # in place
    return lines


def _wrap(text: Text, width: int) -> list[Text]:
    """``text`` in pieces of ``width`` cells at most, broken at spaces; a word
    longer than ``width`` is a piece of its own, whole."""
    s, pieces, i = text.plain, [], 0
    while i < len(s):
        while i < len(s) and s[i] == " ":
            i += 1
        if i >= len(s):
            break
        if len(s) - i <= width:
            pieces.append(text[i:])
            break
        cut = s.rfind(" ", i, i + width + 1)
        if cut <= i:
            cut = s.find(" ", i)
            cut = len(s) if cut < 0 else cut
        pieces.append(text[i:cut])
        i = cut
    return pieces


def _div_lines(r: _Row, x: int, width: int) -> list[Text]:
    """A row's divergences, one line each (folded by field and rule over a
    decode run), the likely cause first; past ``MAX_ROW_DIVERGENCES``, the
    rest named in one line."""
    folds: dict[tuple, list[Divergence]] = {}
    for d in sorted(r.divs, key=causal_key):
        folds.setdefault((d.field, d.rule), []).append(d)
    out = []
    groups = list(folds.values())
    for ds in groups[:MAX_ROW_DIVERGENCES]:
        d = ds[0]
        tail = Text()
        tail.append(d.field, style="bold")
        steps = len({x.step for x in ds})
        values = len({(repr(x.recorded), repr(x.expected)) for x in ds})
        if steps > 1:
            tail.append(f" at {count(steps, 'step')}, first at {d.step}")
        elif values > 1:
            tail.append(f", {_n(values)} of them, the first")
        if d.kind == "kv-content" and isinstance(d.recorded, str):
            tail.append(": ")   # the expected value is the request's own prefix, always
            tail.append(d.recorded, style="red")
        else:
            tail.append(": recorded ")
            tail.append(_compact(d.field, d.recorded), style="red")
            tail.append(", expected ")
            tail.append(_compact(d.field, d.expected), style="green")
        rid = rule_id(d.rule)
        if rid:
            tail.append(f" (rule {rid})", style="dim")
        out += _hang(_bang(x), tail, x + 2, width)
    rest = groups[MAX_ROW_DIVERGENCES:]
    if rest:
        names = ", ".join(dict.fromkeys(ds[0].field for ds in rest))
        out += _hang(_bang(x), Text(f"and {names}", style="red"), x + 2, width)
    return out


def _bang(x: int) -> Text:
    """The head of a divergence's line: ``!`` at column ``x``."""
    head = Text(" " * x)
    head.append("! ", style="bold red")
    return head


def _compact(field: str, v) -> str:
    """A value on one line: long lists of block ids with their runs as ``a–b``."""
    if isinstance(v, list) and len(v) > 8 and all(isinstance(x, int) and not isinstance(x, bool)
                                                  for x in v):
        return f"[{_ids(v)}]"
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        if field.endswith("more_groups"):   # KV-cache groups 1, 2, ...: named as value_text does
            return "; ".join(f"group {i} {_compact('', x)}" for i, x in enumerate(v, 1))
        return "[" + ", ".join(_compact(field, x) for x in v) + "]"
    return value_text(field, v)


# --------------------------------------------------------------------------- one step

MAX_QUEUED = 40   # ids listed per queue (all of them with a request asked for)


def show_step(view: StepView, divergences: list[Divergence] | None, console: Console | None = None,
              note: str | None = None) -> None:
    """Print one step: the batch, the queues, the free blocks, each live
    request's block table, and ``divergences`` (those of this step, from a
    replay), marked on the rows they concern. ``note``: why there are none to
    show (a trace replay refused). With ``view.request`` set, only that
    request (and the step-wide divergences)."""
    console = console or make_console()
    only = view.request
    divs = [d for d in divergences or () if d.step == view.step and (only is None or d.req in (only, None))]
    marked = {d.req for d in divs if d.req is not None}
    wide = {d.field for d in divs if d.req is None}
    s, cfg = view.record, view.header.config

    console.print(Text(f"{view.path} · step {view.step} (line {view.line})"
                       + (f" · request {only}" if only else ""), style="bold"))
    tokens = sum(b.scheduled for b in view.batch)
    free = Text("not recorded" if s.num_free_blocks is None else
                f"{_n(s.num_free_blocks)} of {_n(cfg.num_blocks - 1)} usable, after the step")
    if "num_free_blocks" in wide:
        free.append("  ! diverges", style="bold red")
    n = len(view.batch)
    rows = [("batch", f"{count(n, 'request')}, {count(tokens, 'token')} scheduled (budget "
                      f"{_n(cfg.token_budget)})"),
            ("free blocks", free)]
    groups = kv_groups_text(view.header.features)
    if groups:
        rows.append(("KV cache", groups))
    console.print(_grid(rows + _events(view, only)))
    if view.failed:
        console.print(Text(f"schedule() raised {view.failed}: the engine stopped in this step"
                           + ("; the lookups it made before are under the queues"
                              if s.lookups else ""), style="bold red"))
    if note:
        console.print(Text(note, style="yellow"))

    batch = [b for b in view.batch if only is None or b.req == only]
    console.print(Text("\nbatch", style="bold"))
    if batch:
        console.print(_batch_table(batch, marked, view.groups))
    else:
        console.print(Text("  not scheduled in this step" if only else "  nothing scheduled",
                           style="dim"))
    _print_queues(view, only, marked, console)
    _print_tables(view, only, marked, console)
    _print_divergences(view, divs, note, console)


def _mark(req: str | None, marked: set) -> Text:
    return Text("!", style="bold red") if req in marked else Text(" ")


def _ids(ids: list[int]) -> str:
    """Block ids in order, runs of three or more consecutive ids as ``a–b``."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{ids[i]}–{ids[j]}")
        else:
            out.extend(str(x) for x in ids[i:j + 1])
        i = j + 1
    return " ".join(out)


def _group_ids(groups: list[list[int]], n_groups: int, new: bool) -> str:
    def one(ids):
        if new:
            return ("+" + _ids(ids)) if ids else "none new"
        return f"({_n(len(ids))}) {_ids(ids)}" if ids else "(0)"
    if len(groups) <= 1:
        return one(groups[0] if groups else [])
    return "\n".join(f"g{g}: {one(ids)}" for g, ids in enumerate(groups))


def _batch_table(batch, marked: set, n_groups: int) -> Table:
    t = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1))
    t.add_column("", no_wrap=True, width=1)
    t.add_column("request", overflow="fold")
    t.add_column("admitted", no_wrap=True)
    t.add_column("computed", justify="right", no_wrap=True)
    t.add_column("sched", justify="right", no_wrap=True)
    t.add_column("blocks (whole table, or +new)", ratio=1)
    for b in batch:
        sched = _n(b.scheduled) + (f" ({count(b.drafts, 'draft')})" if b.drafts else "")
        t.add_row(_mark(b.req, marked), b.req, b.how, _n(b.computed), sched,
                  _group_ids(b.blocks, n_groups, b.how == "running"))
    return t


def _events(view: StepView, only: str | None) -> list:
    """The step's other news, as rows: preemptions, frees, the connector's
    lookups and loads."""
    s = view.record
    rows = []

    def mine(req):
        return only is None or req == only

    pre = [r for r in s.preempted if mine(r)]
    if pre:
        rows.append(("preempted", ", ".join(pre)))
    fin = [r for r in s.finished if mine(r)]
    if fin:
        rows.append(("freed", ", ".join(fin) + " (finished since the last step)"))
    looks = [lk for lk in s.lookups if mine(lk.req)]
    if looks:
        rows.append(("lookups", "; ".join(
            f"{lk.req} local {_n(lk.local)} external "
            + ("not ready" if lk.ext is None else _n(lk.ext)) + (" async" if lk.load_async else "")
            for lk in looks)))
    loads = [ld for ld in s.loads or () if mine(ld.req)]
    if loads:
        rows.append(("loads", "; ".join(f"{ld.req} [{ld.start}, {ld.end})" for ld in loads)))
    return rows


def _grid(rows) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(no_wrap=True, style="bold")
    t.add_column()
    for row in rows:
        t.add_row(*row)
    return t


_WAITING_KIND = {"WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": "for its grammar",
                 "WAITING_FOR_STREAMING_REQ": "for its next input"}


def _print_queues(view: StepView, only: str | None, marked: set, console: Console) -> None:
    console.print(Text("\nqueues after the step", style="bold"))
    if only is not None and any(b.req == only for b in view.batch):
        console.print(Text(f"  {only} is in the batch", style="dim"))
        return
    queued = [p for p in view.queued if only is None or p.req == only]
    if only is not None and not queued:
        console.print(Text(f"  {only} is not live at this step (finished, or aborted)",
                           style="dim"))
        return
    t = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1))
    t.add_column("", no_wrap=True, width=1)
    t.add_column("queue", no_wrap=True)
    t.add_column("request", overflow="fold")
    t.add_column("placed by", ratio=1)
    for q in QUEUES:
        items = [p for p in queued if p.queue == q]
        if not items:
            if only is None and q != "running, not scheduled":
                t.add_row("", q, Text("none", style="dim"), "")
            continue
        # Requests known only by their arrival, in one row, in arrival order.
        plain = [p for p in items if not p.exact and p.news.startswith("arrived")
                 and p.status == "WAITING" and p.req not in marked and p.lookup is None]
        if len(plain) < 2 or only is not None:
            plain = []
        rest = [p for p in items if p not in plain]
        head = f"{q} ({_n(len(items))})"
        if plain:
            ids = ", ".join(p.req for p in plain[:MAX_QUEUED])
            if len(plain) > MAX_QUEUED:
                ids += f", … {_n(len(plain) - MAX_QUEUED)} more"
            t.add_row("", head, ids, "arrival")
            head = ""
        for p in rest[:MAX_QUEUED]:
            how = "recorded state" if p.exact else p.news
            if p.status in _WAITING_KIND:
                how += f", {_WAITING_KIND[p.status]}"
            t.add_row(_mark(p.req, marked), head, p.req, how)
            if p.lookup is not None:
                t.add_row("", "", "", Text(_lookup_text(p), style="cyan"))
            head = ""
        if len(rest) > MAX_QUEUED:
            t.add_row("", "", Text(f"… {_n(len(rest) - MAX_QUEUED)} more", style="dim"),
                      Text("--request ID shows one", style="dim"))
    console.print(t)
    console.print(Text("placed by the step's recorded state, else by the last news of the "
                       "request in the records up to the step (@ its step)", style="dim"))


def _lookup_text(p: Placed) -> str:
    """A request the step looked up and did not schedule, in words: what its
    lookup found (``get_computed_blocks``' local hit, the connector's
    ``get_num_new_matched_tokens``), and what became of it."""
    lk = p.lookup
    what = "resumption" if p.status == "PREEMPTED" else "admission"
    local = f"local hit {count(lk.local, 'token')}"
    if lk.ext is None:
        return f"{what} failed at this step: {local}, the connector not ready yet"
    if p.queue == "waiting for remote KV":
        return (f"looked up at this step: {local}, external hit {_n(lk.ext)} loading "
                "asynchronously; waits for the load")
    return (f"{what} failed at this step: {local}, external hit {_n(lk.ext)}"
            + (" (asynchronous)" if lk.load_async else ""))


def _print_tables(view: StepView, only: str | None, marked: set, console: Console) -> None:
    order = [b.req for b in view.batch] + [p.req for p in view.queued]
    reqs = [r for r in dict.fromkeys(order) if (only is None or r == only)
            and any(view.table_of(r))]
    console.print(Text("\nblock tables at the step", style="bold"))
    if not reqs:
        console.print(Text("  no blocks held", style="dim"))
        return
    t = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1))
    t.add_column("", no_wrap=True, width=1)
    t.add_column("request", overflow="fold")
    if view.groups > 1:
        t.add_column("group", no_wrap=True, justify="right")
    t.add_column("blocks", justify="right", no_wrap=True)
    t.add_column("block ids", ratio=1)
    differs = False
    for req in reqs:
        table = view.table_of(req)
        st = view.states.get(req)
        recorded = None if st is None else [st.block_ids, *(st.more_groups or ())]
        for g, ids in enumerate(table):
            cells = [_mark(req, marked) if g == 0 else Text(""), req if g == 0 else ""]
            if view.groups > 1:
                cells.append(str(g))
            source = " (recorded state)" if req in view.from_state else ""
            t.add_row(*cells, _n(len(ids)), _ids(ids) + source)
            if recorded is not None and g < len(recorded) and recorded[g] != ids:
                differs = True
                t.add_row(Text(""), "", *([""] if view.groups > 1 else []), "",
                          Text(f"state: {_ids(recorded[g]) or 'none'}", style="yellow"))
    console.print(t)
    console.print(Text("from the whole table of the last admission plus the new blocks of each "
                       "step since" + ("; \"state:\" where the step's recorded state differs "
                                       "(0 is the null block: a block a sliding window let go)"
                                       if differs else ""), style="dim"))


def _print_divergences(view: StepView, divs: list[Divergence], note: str | None,
                       console: Console) -> None:
    console.print(Text(f"\ndivergences at step {view.step} ({_n(len(divs))})", style="bold"))
    if not divs:
        console.print(Text("  " + ("not replayed" if note else "none"), style="dim"))
        return
    for d in sorted(divs, key=causal_key):   # the likely cause first, as replay lists them
        head = Text("! ", style="bold red")
        head.append(d.req if d.req is not None else "step-wide", style="bold")
        head.append(f" {d.field}")
        head.append(f"  ({d.kind}" + (f", line {d.line})" if d.line is not None else ")"),
                    style="dim")
        console.print(head)
        t = Table.grid(padding=(0, 1))
        t.add_column(no_wrap=True, width=1)
        t.add_column(no_wrap=True, style="dim")
        t.add_column()
        t.add_row("", "recorded", _whole(d.field, d.recorded))
        t.add_row("", "expected", _whole(d.field, d.expected))
        why = why_text(d)
        if why:
            t.add_row("", "derived" if why.startswith("expected ") else "why", d.why)
        t.add_row("", "rule", rule_words(str(d.rule)))
        console.print(t)


def _whole(field: str, v) -> str:
    """A recorded or expected value in full, in words: never cut."""
    return value_text(field, v)
