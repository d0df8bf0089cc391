"""``kvtrace show``: the run summary, one request's history, or one step, in the terminal."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..findings import Divergence, causal_key
from .at_step import QUEUES, StepView, one_request
from .figures import HistoryRow, Mark, RequestTimeline, RunSummary, Series, kv_groups_text, percent
from .summary import summarize
from .failures import value_text, why_text
from .terminal import make_console, replayed_up_to

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60


def show(trace: str | os.PathLike, request: str | None = None, console: Console | None = None,
         collapse_decode: bool = True) -> RunSummary:
    """Print the run summary of ``trace``; with ``request``, also that request's history.

    ``request`` is a request id, or a prefix of exactly one (vLLM ids end in a
    random suffix: ``0-a3c1`` finds ``0-a3c17fc3``). Runs of decode steps with
    nothing else happening are printed as one row unless ``collapse_decode`` is
    false. Raises ``TraceError`` for an unusable trace and ``UnknownRequest``
    when no request, or more than one, matches.
    """
    console = console or make_console()
    if request is None:
        s = summarize(trace, max_timelines=0)
        print_summary(s, console)
        return s
    s = summarize(trace, keep=lambda r: r.startswith(request), max_timelines=0,
                  history=lambda r: r.startswith(request))
    ids = sorted(s.timelines, key=lambda r: s.timelines[r].index)   # those it begins
    tl = s.timelines[one_request(request, ids, trace, "in the trace", s.requests)]
    print_summary(s, console, brief=True)
    print_request(s, tl, console, collapse_decode=collapse_decode)
    return s


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
    console.print(Text(f"{s.path} · engine {h.engine} {h.engine_version} · {s.steps} steps · "
                       f"{s.requests} requests", style="bold"))
    note = replayed_up_to(s.truncation, "read")
    if note:
        console.print(Text(f"truncated: {note}", style="yellow"))
    if s.end is not None and (s.end.status != "complete" or s.end.dropped_events):
        console.print(Text(f"the recorder closed this trace as '{s.end.status}'"
                           + (f", {s.end.dropped_events} events dropped" if s.end.dropped_events else "")
                           + (f": {s.end.error}" if s.end.error else ""), style="yellow"))
    if brief:
        return
    budget = cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    t.add_row("config", f"block size {cfg.block_size}, {cfg.num_blocks} blocks ({s.usable_blocks} usable), "
                        f"token budget {budget}, max_num_seqs {cfg.max_num_seqs}, policy {cfg.policy}, "
                        f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}"
                        + (f", connector {cfg.connector.name} (on a failed load: "
                           f"{cfg.connector.load_failure_policy})" if cfg.connector else ""))
    groups = kv_groups_text(h.features)
    if groups:
        t.add_row("KV cache", groups)
    fin = ", ".join(f"{n} {r}" for r, n in sorted(s.finished.items())) or "none"
    unfinished = s.requests - sum(s.finished.values())
    t.add_row("requests", f"{s.requests} (finished: {fin}"
                          + (f"; {unfinished} not finished" if unfinished else "") + f"); "
                          f"at most {s.max_live} at once")
    t.add_row("steps", f"{s.steps}: {s.scheduled_tokens} tokens scheduled "
                       f"({s.prefill_tokens} prefill, {s.decode_tokens} decode)")
    t.add_row("preemptions", f"{s.preemptions} (requests preempted: {s.preempted_requests})")
    t.add_row("prefix hit rate", f"{percent(s.prefix_hit_rate)} ({s.local_cached_tokens} of "
                                 f"{s.prompt_tokens} prompt tokens from the local cache)")
    t.add_row("external hit rate", f"{percent(s.external_hit_rate)} ({s.external_cached_tokens} prompt "
                                   "tokens from the connector)")
    if s.stats_requests < s.requests:
        t.add_row("", Text(f"prompt stats for {s.stats_requests} of {s.requests} requests", style="dim"))
    if s.lookups or s.loads:
        t.add_row("connector", f"{s.lookups} lookups ({s.lookups_not_ready} not ready, {s.lookups_async} "
                               f"async), {s.loads} loads ({s.load_tokens} tokens), {s.finished_recving} "
                               f"async loads finished, {s.failed_recving} failed, "
                               f"{s.invalid_blocks} invalid blocks")
    if s.drafts_scheduled:
        t.add_row("drafts", f"{s.drafts_scheduled} scheduled, {s.drafts_accepted} accepted "
                            f"({percent(s.drafts_accepted / s.drafts_scheduled)})")
    if s.structured:
        # The scheduler looks at a grammar when the request comes up in the waiting pass.
        waited = (f", grammar found compiled {s.grammar_wait_steps / s.grammar_ready:.1f} steps "
                  "after arrival on average" if s.grammar_ready else "")
        t.add_row("structured outputs", f"{s.structured} requests{waited}, {s.grammar_failed} "
                                        f"failed to compile, {s.grammar_rejected} refused "
                                        "the tokens sampled")
    if s.embeds:
        t.add_row("prompt embeddings", f"{s.embeds} requests ({s.embeds_mixed} mixed with token ids)")
    if s.peak_kv_used is not None:
        t.add_row("KV usage", f"peak {s.peak_kv_used}/{s.usable_blocks} blocks, mean "
                              f"{s.mean_kv_used:.1f} ({percent(s.mean_kv_used / max(1, s.usable_blocks))})")
        t.add_row("", Text(sparkline(s.kv_used, s.usable_blocks), style="cyan"))
    else:
        t.add_row("KV usage", Text("not recorded (no num_free_blocks)", style="dim"))
    t.add_row("tokens/step", Text(sparkline(s.sched_tokens, budget), style="green"))
    console.print(t)


# --------------------------------------------------------------------------- one request


def print_request(s: RunSummary, tl: RequestTimeline, console: Console,
                  collapse_decode: bool = True) -> None:
    bs = s.header.config.block_size
    console.print(Text(f"request {tl.req}", style="bold"))
    console.print(f"arrival: before step {tl.arrival_step} (line {tl.arrival_line}), prompt "
                  f"{tl.prompt_len} tokens, max_tokens {tl.max_tokens}, priority {tl.priority}, "
                  f"arrival_time {tl.arrival_time:.3f}")
    table = Table(header_style="bold", expand=False)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("event", no_wrap=True)
    table.add_column("computed", justify="right")
    table.add_column("scheduled", justify="right")
    table.add_column("new blocks")
    table.add_column("blocks", justify="right")
    table.add_column("detail")
    for row in _rows(tl, collapse_decode):
        table.add_row(*row)
    console.print(table)
    if tl.finish_reason:
        console.print(f"finish: {tl.finish_reason} at step {tl.finish_step}")
    else:
        console.print(Text("finish: not finished in the trace", style="yellow"))
    console.print(f"scheduled in {tl.steps_scheduled} steps, {tl.tokens_scheduled} tokens; "
                  f"{tl.num_preemptions} preemptions; block size {bs}")
    if tl.prefill_stats is not None:
        p = tl.prefill_stats
        console.print(f"prompt stats (step {tl.stats_step}): num_prompt_tokens {p.num_prompt_tokens}, "
                      f"num_local_cached_tokens {p.num_local_cached_tokens}, num_external_cached_tokens "
                      f"{p.num_external_cached_tokens}, num_cached_tokens {p.num_cached_tokens}, "
                      f"num_computed_tokens {p.num_computed_tokens}, num_cache_creation_tokens "
                      f"{p.num_cache_creation_tokens}")
    if tl.legacy is not None:
        console.print(f"legacy counters (step {tl.stats_step}): num_cached_tokens "
                      f"{tl.legacy.num_cached_tokens}, num_external_computed_tokens "
                      f"{tl.legacy.num_external_computed_tokens}")
    if tl.prefill_stats is None and tl.legacy is None:
        console.print(Text("prompt stats: none recorded", style="dim"))


_MARK_STYLE = {"preempted": "bold yellow", "load": "cyan", "async-wait": "cyan", "load-done": "cyan",
               "load-failed": "bold red", "finished": "green", "aborted": "red", "not-ready": "dim",
               "lookup": "cyan", "arrival": "bold"}


def _rows(tl: RequestTimeline, collapse: bool):
    """Marks and scheduled steps merged in step order, decode runs collapsed."""
    marks = [m for m in tl.marks if m.kind not in ("admitted", "resumed")]
    split = {m.step: m.text.split(" (", 1)[1].split(")", 1)[0] for m in tl.marks
             if m.kind in ("admitted", "resumed") and " (" in m.text}
    hist = tl.history or []
    items: list[tuple[int, int, object]] = []
    for i, m in enumerate(marks):
        # At one step: lookups and loads before the scheduling, finishes after it.
        order = 2 if m.kind in ("finished", "aborted", "load-done", "load-failed") else 0
        items.append((m.step, order, m))
    for r in hist:
        items.append((r.step, 1, r))
    items.sort(key=lambda t: (t[0], t[1]))
    run: list[HistoryRow] = []
    marked = {m.step for m in marks}

    def flush():
        if not run:
            return []
        if len(run) == 1:
            out = [_hist_row(run[0], split)]
        else:
            a, b = run[0], run[-1]
            nb = sum(len(r.new_blocks) for r in run)
            drafts = sum(r.drafts for r in run)
            spec = (f", {sum(r.accepted or 0 for r in run)} of {drafts} drafts accepted"
                    if drafts else "")
            out = [(f"{a.step}–{b.step}", Text("decode", style="dim"), f"{a.computed}→{b.computed_after}",
                    str(sum(r.scheduled for r in run)), f"{nb} blocks" if nb else "", str(b.blocks),
                    Text(f"{len(run)} decode steps{spec}", style="dim"))]
        run.clear()
        return out

    for step, _, it in items:
        if isinstance(it, HistoryRow):
            plain = (collapse and it.how == "running" and it.phase == "decode" and it.step not in marked)
            if plain and (not run or run[-1].step == it.step - 1):
                run.append(it)
                continue
            yield from flush()
            if plain:
                run.append(it)
                continue
            yield _hist_row(it, split)
        else:
            yield from flush()
            yield _mark_row(it)
    yield from flush()


def _hist_row(r: HistoryRow, split: dict[int, str]):
    how = {"new": "admitted", "resumed": "resumed", "running": "scheduled"}[r.how]
    style = "bold" if r.how != "running" else ""
    blocks = ", ".join(map(str, r.new_blocks[:12])) + (" …" if len(r.new_blocks) > 12 else "")
    detail = f"{r.phase}" + (f", {r.status}" if r.status != "RUNNING" else "")
    if r.drafts:
        detail += (f", {r.accepted} of {r.drafts} drafts accepted" if r.accepted is not None
                   else f", {r.drafts} drafts")
    if r.how != "running" and r.step in split:
        source = split[r.step]
        detail += f", {source}" if source.endswith("last turn") else f", hit: {source}"
    return (str(r.step), Text(how, style=style), f"{r.computed}→{r.computed_after}", str(r.scheduled),
            blocks, str(r.blocks), detail)


def _mark_row(m: Mark):
    return (str(m.step), Text(m.kind, style=_MARK_STYLE.get(m.kind, "")), "", "", "", "", m.text)


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
                f"{s.num_free_blocks} of {cfg.num_blocks - 1} usable, after the step")
    if "num_free_blocks" in wide:
        free.append("  ! diverges", style="bold red")
    n = len(view.batch)
    rows = [("batch", f"{n} request{'s' if n != 1 else ''}, {tokens} token"
                      f"{'s' if tokens != 1 else ''} scheduled (budget {cfg.token_budget})"),
            ("free blocks", free)]
    groups = kv_groups_text(view.header.features)
    if groups:
        rows.append(("KV cache", groups))
    console.print(_grid(rows + _events(view, only)))
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
        return f"({len(ids)}) {_ids(ids)}" if ids else "(0)"
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
        sched = str(b.scheduled) + (f" ({b.drafts} drafts)" if b.drafts else "")
        t.add_row(_mark(b.req, marked), b.req, b.how, str(b.computed), sched,
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
            f"{lk.req} local {lk.local} external "
            + ("not ready" if lk.ext is None else str(lk.ext)) + (" async" if lk.load_async else "")
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
    t.add_column("placed by", no_wrap=True)
    for q in QUEUES:
        items = [p for p in queued if p.queue == q]
        if not items:
            if only is None and q != "running, not scheduled":
                t.add_row("", q, Text("none", style="dim"), "")
            continue
        # Requests known only by their arrival, in one row, in arrival order.
        plain = [p for p in items if not p.exact and p.news.startswith("arrived")
                 and p.status == "WAITING" and p.req not in marked]
        if len(plain) < 2 or only is not None:
            plain = []
        rest = [p for p in items if p not in plain]
        head = f"{q} ({len(items)})"
        if plain:
            ids = ", ".join(p.req for p in plain[:MAX_QUEUED])
            if len(plain) > MAX_QUEUED:
                ids += f", … {len(plain) - MAX_QUEUED} more"
            t.add_row("", head, ids, "arrival")
            head = ""
        for p in rest[:MAX_QUEUED]:
            how = "recorded state" if p.exact else p.news
            if p.status in _WAITING_KIND:
                how += f", {_WAITING_KIND[p.status]}"
            t.add_row(_mark(p.req, marked), head, p.req, how)
            head = ""
        if len(rest) > MAX_QUEUED:
            t.add_row("", "", Text(f"… {len(rest) - MAX_QUEUED} more", style="dim"),
                      Text("--request ID shows one", style="dim"))
    console.print(t)
    console.print(Text("placed by the step's recorded state, else by the last news of the "
                       "request in the records up to the step (@ its step)", style="dim"))


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
            t.add_row(*cells, str(len(ids)), _ids(ids) + source)
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
    console.print(Text(f"\ndivergences at step {view.step} ({len(divs)})", style="bold"))
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
        t.add_row("", "rule", str(d.rule))
        console.print(t)


def _whole(field: str, v) -> str:
    """A recorded or expected value in full, in words: never cut."""
    return value_text(field, v)
